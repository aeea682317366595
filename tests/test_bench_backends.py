"""`attnserve bench backends`: each backend's sub-run planned and read into a row (from a stand-in
sub-run's JSON), ratios to the first backend per workload, the table, bad options refused before
any run, and a small run end to end on the CPU (each backend the selector finds able here, in a
fresh process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from attnserve.bench import backends
from attnserve.bench.backends import Row, Run, execute, format_table, plan, set_ratios
from attnserve.bench.families import Outcome
from attnserve.cli import main

CPU = f"--device cpu --kv-cache-memory-bytes {8 << 20} --num-prompts 4 --min-len 8 --max-len 16"


def _row(backend: str, workload: str, tokens_per_s: float | None, share: float = 0.2) -> Row:
    status = "ok" if tokens_per_s is not None else "failed"
    row = Row(backend, workload, status, 1.0, "attnserve bench throughput ...")
    row.output_tokens_per_s, row.attention_share = tokens_per_s, share
    row.error = None if tokens_per_s is not None else "exit status 2: attnserve: error: no GPU"
    return row


def test_each_run_is_bench_throughput_with_its_backend_and_kind() -> None:
    args = argparse.Namespace(
        model="qwen3-0.6b", workloads=["long", "flags"], profile_every=8, extra_args="--seed 3"
    )
    runs = plan(args, ["TORCH_SDPA", "TRITON"])
    assert [(r.workload, r.backend) for r in runs] == [
        ("long", "TORCH_SDPA"), ("long", "TRITON"), ("flags", "TORCH_SDPA"), ("flags", "TRITON"),
    ]  # fmt: skip
    first, last = runs[0].arguments, runs[-1].arguments
    assert first[first.index("--workload") + 1] == "long"
    assert "--workload" not in last  # the length flags of --extra-args
    for flag, value in [("--attention-backend", "TRITON"), ("--profile-run", "8")]:
        assert last[last.index(flag) + 1] == value
    assert last[last.index("--profile-steps") + 1] == "0"
    assert last[-2:] == ["--seed", "3"]  # after the command's own, so it may override them


def test_a_row_from_the_sub_runs_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result: dict[str, Any] = {
        "output_tokens_per_s": 1234.5,
        "run_breakdown": {"share": {"attention": 0.375, "matmul": 0.5}},
    }

    def ran(benchmark: str, arguments: list[str], *rest: Any) -> Outcome:
        assert benchmark == "throughput"
        return Outcome("ok", 2.0, "attnserve bench throughput ...", result)

    monkeypatch.setattr(backends, "run_bench", ran)
    row = execute(Run("TRITON", "standard", []), tmp_path, 60.0)
    assert (row.status, row.output_tokens_per_s, row.attention_share) == ("ok", 1234.5, 0.375)
    assert row.ratio is None and row.result == result


def test_ratios_are_to_the_first_backend_on_the_same_workload() -> None:
    rows = [
        _row("TORCH_SDPA", "standard", 1000.0),
        _row("TRITON", "standard", 2500.0),
        _row("TORCH_SDPA", "long", None),  # failed: no ratio on this workload
        _row("TRITON", "long", 900.0),
    ]
    set_ratios(rows, "TORCH_SDPA")
    assert [row.ratio for row in rows] == [1.0, 2.5, None, None]
    table = format_table(rows, "TORCH_SDPA").splitlines()
    assert table[0].split() == ["backend", "workload", "output", "tok/s", "attention", "share",
                                "vs", "TORCH_SDPA"]  # fmt: skip
    assert table[2].split() == ["TRITON", "standard", "2,500.0", "20.0%", "2.50x"]
    assert table[3].split() == ["TORCH_SDPA", "long", "FAILED", "-", "-"]
    assert table[4].split() == ["TRITON", "long", "900.0", "20.0%", "-"]
    assert table[5] == "TORCH_SDPA long: exit status 2: attnserve: error: no GPU"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--workloads", "standard,bursty"], "--workloads: 'bursty' is none of standard, chat"),
        (["--backends", "TRITON,TRITON"], "--backends names one twice"),
        (["--profile-every", "0"], "--profile-every must be >= 1, got 0"),
        (["--timeout", "0"], "--timeout must be > 0 seconds"),
        (["--extra-args", "--attention-backend FLEX_ATTENTION"], "set by bench backends itself"),
        (["--extra-args=--workload=long"], "--workload=long is set by bench backends itself"),
        (["--extra-args", "--seed '3"], '--extra-args "--seed \'3"'),
    ],
)
def test_bad_options_are_refused_before_any_run(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "backends", "--model", "llama-tiny", *options]) == 2
    assert message in capsys.readouterr().err


def test_an_empty_list_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "backends", "--backends", ","])
    assert "expected comma-separated names like A,B" in capsys.readouterr().err


def test_every_able_backend_end_to_end_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "backends.json"
    options = ["--model", "llama-tiny", "--workloads", "flags", "--profile-every", "4"]
    options += ["--extra-args", CPU, "--out-dir", str(tmp_path / "runs"), "--json", str(out)]
    assert main(["bench", "backends", *options]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["backends"] == ["TORCH_SDPA", "CPU_NATIVE"]  # those able on the CPU
    rows = report["rows"]
    assert [(r["backend"], r["workload"], r["status"]) for r in rows] == [
        ("TORCH_SDPA", "flags", "ok"),
        ("CPU_NATIVE", "flags", "ok"),
    ]
    for row in rows:
        assert row["output_tokens_per_s"] > 0 and 0 < row["attention_share"] < 1
        assert row["result"]["backend"] == row["backend"]
        assert row["result"]["run_breakdown"]["scope"] == "step of the whole run"
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    assert (tmp_path / "runs" / "flags_CPU_NATIVE.json").is_file()
    assert table.splitlines()[1].split()[:2] == ["TORCH_SDPA", "flags"]


def test_throughput_refuses_a_negative_profile_run(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
    assert main(["bench", "throughput", *tiny, "--profile-run", "-1"]) == 2
    assert "--profile-run must be >= 0 (0: off), got -1" in capsys.readouterr().err
