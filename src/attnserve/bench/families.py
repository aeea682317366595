"""`attnserve bench families`: every preset family's standard workload and batch latencies
against their bounds, in one table, so no family falls behind unseen.

For each `--models` entry (default: one preset per family, dummy weights at the real shapes), in
a fresh process each (`attnserve bench ... --json FILE`, capped at `--timeout` seconds): `bench
throughput` on the standard offline workload (`--num-prompts` requests, `--min-len` ..
`--max-len` tokens in and out, no breakdown), whose output tok/s stands against the workload's
bound; and `bench latency` at each of `--batch-sizes` (`--input-len` in, `--output-len` out,
`--num-iters`), whose median time per output token stands against the bound of the batch's
decode steps. Both bounds are the sub-runs' own (bench/bound.py, at the rates each run measures
first). A run that fails or runs out of time is a row that says so, and the others go on; the
exit status is 1 if any did. `--out-dir` keeps each run's JSON and stderr log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnserve.bench.common import check_output_files, check_positive, progress, write_json

FAMILY_PRESETS = [
    "llama-3-8b",
    "qwen3-0.6b",
    "qwen3-30b-a3b",
    "mixtral-8x7b",
    "gemma-2-9b",
    "gemma-3-12b",
]
# the flags each sub-run takes from this command, not from --extra-args
_OWN_FLAGS = ("--model", "--json")
# (sub-run's result key of the figure, of its bound, of the fraction, the figure's unit)
_FIGURES = {
    "throughput": ("output_tokens_per_s", "bound_tokens_per_s", "fraction_of_bound", "tok/s"),
    "latency": ("median_tpot_ms", "bound_tpot_ms", "tpot_fraction_of_bound", "ms"),
}


@dataclass(frozen=True)
class Run:
    """One sub-run to make: its model, benchmark, batch size (latency only) and arguments."""

    model: str
    benchmark: str
    batch_size: int | None
    arguments: list[str]

    @property
    def name(self) -> str:
        batch = "" if self.batch_size is None else f"_b{self.batch_size}"
        return f"{self.model.replace('/', '_')}_{self.benchmark}{batch}"


@dataclass
class Row:
    """One sub-run's outcome: status ok, failed or timeout; its figure, bound and fraction."""

    model: str
    benchmark: str
    batch_size: int | None
    status: str
    seconds: float
    command: str
    unit: str
    value: float | None = None
    bound: float | None = None
    fraction_of_bound: float | None = None
    error: str | None = None
    result: dict[str, Any] | None = None


def plan(args: argparse.Namespace) -> list[Run]:
    """Each model's throughput run, then its latency runs, in the order they run."""
    extra = shlex.split(args.extra_args)
    runs = []
    for model in args.models:
        common = ["--model", model, "--load-format", "dummy"]
        workload = ["--num-prompts", args.num_prompts, "--min-len", args.min_len]
        workload += ["--max-len", args.max_len, "--profile-steps", 0]
        runs.append(Run(model, "throughput", None, _strings(common + workload + extra)))
        for batch in args.batch_sizes:
            sizes = ["--batch-size", batch, "--input-len", args.input_len]
            sizes += ["--output-len", args.output_len, "--num-iters", args.num_iters]
            runs.append(Run(model, "latency", batch, _strings(common + sizes + extra)))
    return runs


def _strings(values: list[object]) -> list[str]:
    return [str(value) for value in values]


def run_command(command: list[str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run `command` in its own process group with stderr to `log`; its exit status (None if it
    ran out of `timeout` seconds: the group is killed) and its wall time."""
    started = time.perf_counter()
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True
        )
        try:
            status: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return status, time.perf_counter() - started


def error_line(log: Path) -> str:
    """Why a run failed, from its stderr: the command's error line, else the exception line of
    its last traceback (the first line after it at column 0), else its last line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("attnserve: error:")]
    if errors:
        return errors[-1]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    after = lines[starts[-1] + 1 :] if starts else []
    exception = [line for line in after if not line[0].isspace()]
    if exception:
        return exception[0]
    return lines[-1].strip() if lines else "no output"


@dataclass(frozen=True)
class Outcome:
    """How a `bench` sub-run ended: status ok, failed or timeout; its wall time, its command as
    a person would type it, and its result (its JSON less "args") or why it has none."""

    status: str
    seconds: float
    command: str
    result: dict[str, Any] | None = None
    error: str | None = None


def run_bench(
    benchmark: str, arguments: list[str], out_dir: Path, name: str, timeout: float
) -> Outcome:
    """`attnserve bench BENCHMARK ARGUMENTS --json` in a fresh process, capped at `timeout`
    seconds; its JSON and stderr log kept in `out_dir` as NAME.json and NAME.log."""
    out, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    command = [sys.executable, "-m", "attnserve.cli", "bench", benchmark, *arguments]
    command += ["--json", str(out)]
    out.unlink(missing_ok=True)  # a kept --out-dir's earlier result is not this run's
    status, seconds = run_command(command, timeout, log)
    shown = shlex.join(["attnserve", *command[3:]])
    if status is None:
        error = f"no result after {timeout:g} s: {error_line(log)}"
        return Outcome("timeout", seconds, shown, error=error)
    if status != 0 or not out.is_file():
        return Outcome("failed", seconds, shown, error=f"exit status {status}: {error_line(log)}")
    result = json.loads(out.read_text())
    result.pop("args", None)
    return Outcome("ok", seconds, shown, result)


def execute(run: Run, out_dir: Path, timeout: float) -> Row:
    """One sub-run in a fresh process, as a row of the table."""
    outcome = run_bench(run.benchmark, run.arguments, out_dir, run.name, timeout)
    value_key, bound_key, fraction_key, unit = _FIGURES[run.benchmark]
    row = Row(
        run.model, run.benchmark, run.batch_size, outcome.status, outcome.seconds,
        outcome.command, unit, error=outcome.error, result=outcome.result,
    )  # fmt: skip
    if outcome.result is not None:
        row.value, row.bound = outcome.result.get(value_key), outcome.result.get(bound_key)
        row.fraction_of_bound = outcome.result.get(fraction_key)
    return row


def _check(args: argparse.Namespace) -> None:
    check_positive(args, "num_prompts", "input_len", "output_len", "num_iters", "timeout")
    if not 1 <= args.min_len <= args.max_len:
        raise ValueError(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {min(args.batch_sizes)}")
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2: time per output token needs two tokens")
    extra_arguments(args.extra_args, _OWN_FLAGS, "families")
    check_output_files(args, "json")


def extra_arguments(text: str, owned: tuple[str, ...], command: str) -> list[str]:
    """`--extra-args` as arguments; ValueError if it does not split or sets a flag of `owned`
    (those `bench COMMAND` sets itself)."""
    try:
        extra = shlex.split(text)
    except ValueError as error:
        raise ValueError(f"--extra-args {text!r}: {error}") from error
    taken = [flag for flag in extra if flag.split("=")[0] in owned]
    if taken:
        raise ValueError(f"--extra-args: {taken[0]} is set by bench {command} itself")
    return extra


def _cell(row: Row | None) -> list[str]:
    """A run's three columns: its figure, its bound and the fraction (or why it has none)."""
    if row is None:
        return ["", "", ""]
    if row.status != "ok":
        return [row.status.upper(), "-", "-"]
    digits = 1 if row.benchmark == "throughput" else 3
    figures = [f"{x:,.{digits}f}" if x is not None else "-" for x in (row.value, row.bound)]
    fraction = row.fraction_of_bound
    return [*figures, f"{fraction:.1%}" if fraction is not None else "-"]


def aligned(lines: list[list[str]]) -> list[str]:
    """The cells in columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    texts = []
    for line in lines:
        cells = [c.rjust(w) for c, w in zip(line, widths, strict=True)]
        texts.append("  ".join([line[0].ljust(widths[0]), *cells[1:]]))
    return texts


def _label(row: Row | Run) -> str:
    batch = "" if row.batch_size is None else f" batch {row.batch_size}"
    return f"{row.model} {row.benchmark}{batch}"


def format_table(rows: list[Row], batch_sizes: list[int]) -> str:
    """One line per model: throughput, then each batch's median TPOT, each against its bound;
    the failed runs' reasons below."""
    header = ["model", "tok/s", "bound", "of bound"]
    for batch in batch_sizes:
        header += [f"TPOT b={batch} ms", "bound ms", "of bound"]
    lines = [header]
    for model in dict.fromkeys(row.model for row in rows):
        mine = {(r.benchmark, r.batch_size): r for r in rows if r.model == model}
        line = [model, *_cell(mine.get(("throughput", None)))]
        for batch in batch_sizes:
            line += _cell(mine.get(("latency", batch)))
        lines.append(line)
    failures = [f"{_label(row)}: {row.error}" for row in rows if row.status != "ok"]
    return "\n".join(aligned(lines) + failures)


def benchmark(args: argparse.Namespace, out_dir: Path) -> list[Row]:
    """Every planned run, one after another, each writing its files to `out_dir`."""
    rows = []
    for run in plan(args):
        progress(f"{_label(run)}: {shlex.join(run.arguments)}")
        row = execute(run, out_dir, args.timeout)
        progress(f"{_label(run)}: {row.status} in {row.seconds:.0f} s")
        rows.append(row)
    return rows


def main(args: argparse.Namespace) -> int:
    _check(args)
    with tempfile.TemporaryDirectory(prefix="attnserve-families-") as scratch:
        out_dir = Path(args.out_dir or scratch)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = benchmark(args, out_dir)
    print(format_table(rows, args.batch_sizes))
    if args.json:
        write_json(args.json, {"rows": [asdict(row) for row in rows]}, args)
    return 0 if all(row.status == "ok" for row in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", nargs="+", default=FAMILY_PRESETS, metavar="MODEL",
        help="presets (or model paths) to run, dummy weights (default: one preset per family)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=256, help="throughput: requests")
    parser.add_argument("--min-len", type=int, default=100, help="throughput: shortest length")
    parser.add_argument("--max-len", type=int, default=1024, help="throughput: longest length")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 8], metavar="B",
        help="latency: one run per batch size",
    )  # fmt: skip
    parser.add_argument("--input-len", type=int, default=128, help="latency: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="latency: output tokens")
    parser.add_argument("--num-iters", type=int, default=3, help="latency: timed iterations")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each run may take (default 300)"
    )
    parser.add_argument(
        "--extra-args", default="", metavar="ARGS",
        help='more arguments for every run, e.g. "--device cpu" or "--max-model-len 4096"',
    )  # fmt: skip
    parser.add_argument("--out-dir", default=None, help="keep each run's JSON and log here")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every row")
    parser.set_defaults(handler=main)
