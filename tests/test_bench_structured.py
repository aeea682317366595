"""`attnserve bench structured` (on the default model's tokenizer) and `bench throughput
--json-schema` (a tiny random Llama with that tokenizer) end to end, in process. Their timings
are printed, not judged: only what they count is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnserve.cli import main
from tests.entrypoints.openai_server import tiny_model_with_tokenizer


def test_structured_counts_a_miss_per_new_schema_and_hits_after(tmp_path: Path) -> None:
    out = tmp_path / "structured.json"
    args = ["--device", "cpu", "--fields", "20", "--repeats", "3", "--batch", "4"]
    assert main(["bench", "structured", *args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["fields"] == 20 and report["schemas"] == 3
    assert report["cache_misses"] == 3  # the same schemas again, and the batch's, are hits
    assert report["cache_hits"] == 4
    assert report["compile_ms_median"] > 0 and report["bitmask_batch"] == 4


def test_throughput_with_a_json_schema_on_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model_with_tokenizer(tmp_path / "model")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}}}))
    out = tmp_path / "throughput.json"
    common = ["--model", str(model), "--device", "cpu", "--num-prompts", "2", "--profile-steps"]
    common += ["0", "--input-len", "8", "--output-len", "24"]
    assert (
        main(["bench", "throughput", *common, "--json-schema", str(schema), "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert 0 < report["json_schema_output_tokens"] <= report["output_tokens"] == 48
    assert "json_schema_cost" in capsys.readouterr().out
    schema.write_text("[1, 2]")
    assert main(["bench", "throughput", *common, "--json-schema", str(schema)]) == 2
    assert "not a JSON schema object" in capsys.readouterr().err
