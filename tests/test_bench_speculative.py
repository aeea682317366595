"""`attnserve bench speculative` end to end, in process, on a tiny random Llama (prompts of a
random block given twice, which prompt lookup drafts from): its timings are printed, not judged;
what it counts is checked — the speculative engine's drafts of the timed batches only, the
outputs equal to the baseline's — and a run without a speculative configuration is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnserve.cli import main

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def test_speculative_counts_the_timed_drafts_and_equal_outputs(tmp_path: Path) -> None:
    out = tmp_path / "speculative.json"
    common = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
    common += ["--dtype", "float32", "--num-prompts", "3", "--output-len", "16"]
    assert (
        main(["bench", "speculative", *common, "--speculative-config", SPEC, "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["outputs_identical"] is True
    assert report["baseline_output_tokens_per_s"] > 0 and report["speedup"] > 0
    assert 0 < report["spec_decode_num_drafts"] <= 3 * 15  # at most one a step of the timed ones
    assert report["spec_decode_num_accepted_tokens"] <= report["spec_decode_num_draft_tokens"]


def test_speculative_refuses_a_run_without_a_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
    assert main(["bench", "speculative", *args]) == 2
    assert "--speculative-config is required" in capsys.readouterr().err
