"""`attnserve bench families` end to end on the tiny dummy preset (each run a fresh process on the
CPU): its table and JSON rows, a failing run reported in its row while the others go on, a run
past its time limit killed, and bad options refused before any run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from attnserve.bench.families import error_line, run_command
from attnserve.cli import main

SIZES = ["--num-prompts", "4", "--min-len", "8", "--max-len", "16", "--batch-sizes", "1", "2"]
SIZES += ["--input-len", "8", "--output-len", "4", "--num-iters", "1"]
CPU = ["--extra-args", f"--device cpu --kv-cache-memory-bytes {8 << 20}"]


def test_every_run_against_its_bound_and_a_failure_in_its_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "families.json"
    models = ["--models", "no-such-preset", "llama-tiny"]
    keep = ["--out-dir", str(tmp_path / "runs"), "--json", str(out)]
    assert main(["bench", "families", *models, *SIZES, *CPU, *keep]) == 1  # a run failed
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    runs = [(r["model"], r["benchmark"], r["batch_size"]) for r in rows]
    assert runs == [
        (model, benchmark, batch)
        for model in ("no-such-preset", "llama-tiny")
        for benchmark, batch in (("throughput", None), ("latency", 1), ("latency", 2))
    ]
    failed, done = rows[:3], rows[3:]
    for row in failed:
        assert row["status"] == "failed" and "no-such-preset" in row["error"]
        assert row["value"] is None and row["fraction_of_bound"] is None
    for row in done:
        assert row["status"] == "ok" and row["error"] is None
        for key in ("value", "bound", "fraction_of_bound"):
            assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0
        assert 0 < row["fraction_of_bound"] <= 1.5
    assert [r["unit"] for r in done] == ["tok/s", "ms", "ms"]
    assert done[1]["result"]["batch_size"] == 1 and done[2]["result"]["batch_size"] == 2
    assert (tmp_path / "runs" / "llama-tiny_latency_b2.json").is_file()
    lines = table.splitlines()
    assert "TPOT b=1 ms" in lines[0] and "TPOT b=2 ms" in lines[0]
    tiny = next(line for line in lines if line.startswith("llama-tiny"))
    assert tiny.count("%") == 3 and "FAILED" not in tiny
    assert next(line for line in lines if line.startswith("no-such-preset")).count("FAILED") == 3
    assert "no-such-preset latency batch 2: exit status 2: attnserve: error:" in table


def test_a_run_past_its_limit_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    script = "import sys, time; print('started', file=sys.stderr, flush=True); time.sleep(600)"
    status, seconds = run_command([sys.executable, "-c", script], 1.0, log)
    assert status is None and seconds < 600  # killed, not waited for
    assert error_line(log) == "started"


def test_the_error_line_of_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(
        "[bench] loading\nTraceback (most recent call last):\n  File 'x.py', line 1\n"
        "    boom()\nRuntimeError: out of memory\nnanobind: leaked 4 instances!\n"
    )
    assert error_line(log) == "RuntimeError: out of memory"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--batch-sizes", "1", "0"], "--batch-sizes must be >= 1, got 0"),
        (["--output-len", "1"], "--output-len must be >= 2"),
        (["--min-len", "16", "--max-len", "8"], "need 1 <= --min-len <= --max-len"),
        (["--extra-args", "--model llama-3-8b"], "--model is set by bench families itself"),
    ],
)
def test_bad_options_are_refused_before_any_run(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "families", "--models", "llama-tiny", *options]) == 2
    assert message in capsys.readouterr().err
