"""`attnserve bench backends`: how much faster end to end a better attention kernel makes the
engine, in one table.

For each attention backend (`--backends`; default: every registered backend the selector finds
able to serve the model's attention here) and each workload kind of `--workloads`
(bench/workloads.py; `flags`: no kind, the workload of the length flags in `--extra-args`, for a
small run), in a fresh process each (`bench throughput --model M --load-format dummy --workload
KIND --attention-backend B --profile-steps 0 --profile-run N --json FILE`, capped at `--timeout`
seconds): the output tok/s end to end, the attention share of step time over the whole workload
run again with one step in `--profile-every` profiled on an eager engine (bench/breakdown.py,
`profile_run`), and the tok/s over the first backend's on the same workload. A run that fails
or runs out of time is a row that says why; the others go on, and the exit status is 1.
`--out-dir` keeps each run's JSON and stderr log (bench/families.py runs them).
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnserve.attention.abstract import AttentionSpec
from attnserve.attention.selector import backend_report
from attnserve.bench.common import check_output_files, check_positive, progress, write_json
from attnserve.bench.families import aligned, extra_arguments, run_bench
from attnserve.bench.workloads import KINDS
from attnserve.config import EngineArgs
from attnserve.config.engine import EngineConfig
from attnserve.model.config import layer_sliding_windows

DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_WORKLOADS = "standard,long,prefix"
FLAGS_WORKLOAD = "flags"  # no --workload kind: the length flags of --extra-args
# the flags each sub-run takes from this command, not from --extra-args
_OWN_FLAGS = (
    "--model",
    "--json",
    "--workload",
    "--attention-backend",
    "--profile-steps",
    "--profile-run",
)


@dataclass(frozen=True)
class Run:
    """One sub-run to make: its backend, workload kind and `bench throughput` arguments."""

    backend: str
    workload: str
    arguments: list[str]

    @property
    def name(self) -> str:
        return f"{self.workload}_{self.backend}"


@dataclass
class Row:
    """One sub-run's outcome: status ok, failed or timeout; its tok/s, attention share of step
    time and ratio to the first backend's tok/s on its workload (None where there is none)."""

    backend: str
    workload: str
    status: str
    seconds: float
    command: str
    output_tokens_per_s: float | None = None
    attention_share: float | None = None
    ratio: float | None = None
    error: str | None = None
    result: dict[str, Any] | None = None


def names(text: str) -> list[str]:
    """An argparse type: comma-separated names like A,B (blanks dropped)."""
    found = [part.strip() for part in text.split(",") if part.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"expected comma-separated names like A,B: {text!r}")
    return found


def attention_specs(config: EngineConfig) -> list[AttentionSpec]:
    """The distinct specs of the model's attention layers on one rank, from its config (heads,
    head size, each layer's sliding window, the logits soft-cap), not from built layers."""
    model, cache = config.model_config, config.cache_config
    ranks = config.parallel_config.tensor_parallel_size
    cap = getattr(model.hf_config, "attn_logit_softcapping", None)
    return [
        AttentionSpec(
            num_heads=model.num_heads // ranks,
            num_kv_heads=model.get_num_kv_heads(ranks),
            head_size=model.head_size,
            dtype=model.dtype,
            kv_cache_dtype=cache.kv_cache_dtype,
            block_size=cache.block_size,
            device=config.device.type,
            sliding_window=window,
            logits_soft_cap=None if cap is None else float(cap),
        )
        for window in dict.fromkeys(layer_sliding_windows(model.hf_config))
    ]


def able_backends(model: str, extra: list[str]) -> list[str]:
    """The registered backends, in the registry's order, that the selector finds able to serve
    `model`'s attention here under the sub-runs' engine flags (those of `extra`). One the built
    model still refuses fails in its row, with the reason."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    EngineArgs.add_cli_args(parser)
    known, _ = parser.parse_known_args(["--model", model, "--load-format", "dummy", *extra])
    config = EngineArgs.from_cli_args(known).create_engine_config()
    report = backend_report(attention_specs(config))
    return [name for name, reasons in report.items() if not reasons]


def plan(args: argparse.Namespace, backends: list[str]) -> list[Run]:
    """Each workload's runs, one per backend, in the order they run."""
    extra = shlex.split(args.extra_args)
    runs = []
    for workload in args.workloads:
        kind = [] if workload == FLAGS_WORKLOAD else ["--workload", workload]
        for backend in backends:
            arguments = ["--model", args.model, "--load-format", "dummy", *kind]
            arguments += ["--attention-backend", backend, "--profile-steps", "0"]
            arguments += ["--profile-run", str(args.profile_every), *extra]
            runs.append(Run(backend, workload, arguments))
    return runs


def execute(run: Run, out_dir: Path, timeout: float) -> Row:
    """One sub-run in a fresh process, as a row of the table (its ratio still unset)."""
    outcome = run_bench("throughput", run.arguments, out_dir, run.name, timeout)
    row = Row(run.backend, run.workload, outcome.status, outcome.seconds, outcome.command)
    row.error, row.result = outcome.error, outcome.result  # the figures below, if it ran
    if outcome.result is not None:
        row.output_tokens_per_s = outcome.result.get("output_tokens_per_s")
        share = outcome.result.get("run_breakdown", {}).get("share", {})
        row.attention_share = share.get("attention")
    return row


def set_ratios(rows: list[Row], baseline: str) -> None:
    """Each row's tok/s over the `baseline` backend's on the same workload, where both ran."""
    base = {r.workload: r.output_tokens_per_s for r in rows if r.backend == baseline}
    for row in rows:
        reference = base.get(row.workload)
        if row.output_tokens_per_s is not None and reference:
            row.ratio = row.output_tokens_per_s / reference


def _cells(row: Row) -> list[str]:
    if row.status != "ok":
        return [row.backend, row.workload, row.status.upper(), "-", "-"]
    tokens, share, ratio = row.output_tokens_per_s, row.attention_share, row.ratio
    return [
        row.backend,
        row.workload,
        "-" if tokens is None else f"{tokens:,.1f}",
        "-" if share is None else f"{share:.1%}",
        "-" if ratio is None else f"{ratio:.2f}x",
    ]


def format_table(rows: list[Row], baseline: str) -> str:
    """One line per run: tok/s, attention share of step time, ratio to `baseline` on the same
    workload; the failed runs' reasons below."""
    header = ["backend", "workload", "output tok/s", "attention share", f"vs {baseline}"]
    failures = [f"{r.backend} {r.workload}: {r.error}" for r in rows if r.status != "ok"]
    return "\n".join(aligned([header, *map(_cells, rows)]) + failures)


def _check(args: argparse.Namespace) -> list[str]:
    """The --extra-args as arguments; ValueError naming the first bad option."""
    check_positive(args, "profile_every")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    known = [*KINDS, FLAGS_WORKLOAD]
    unknown = [kind for kind in args.workloads if kind not in known]
    if unknown:
        raise ValueError(f"--workloads: {unknown[0]!r} is none of {', '.join(known)}")
    for flag, values in (("--workloads", args.workloads), ("--backends", args.backends or [])):
        if len(set(values)) < len(values):
            raise ValueError(f"{flag} names one twice: {','.join(values)}")
    check_output_files(args, "json")
    return extra_arguments(args.extra_args, _OWN_FLAGS, "backends")


def backends_to_run(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """`--backends` (upper-cased, as the selector takes them), else those able to run here."""
    if args.backends:
        return [name.upper() for name in args.backends]
    found = able_backends(args.model, extra)
    if not found:
        hint = f"see `attnserve backends --model {args.model}`"
        raise ValueError(f"no attention backend can serve {args.model} here: {hint}")
    return found


def benchmark(args: argparse.Namespace, backends: list[str], out_dir: Path) -> list[Row]:
    """Every planned run, one after another, each writing its files to `out_dir`; the rows,
    their ratios set."""
    rows = []
    for run in plan(args, backends):
        progress(f"{run.backend} on {run.workload}: {shlex.join(run.arguments)}")
        row = execute(run, out_dir, args.timeout)
        progress(f"{run.backend} on {run.workload}: {row.status} in {row.seconds:.0f} s")
        rows.append(row)
    set_ratios(rows, backends[0])
    return rows


def main(args: argparse.Namespace) -> int:
    backends = backends_to_run(args, _check(args))
    with tempfile.TemporaryDirectory(prefix="attnserve-backends-") as scratch:
        out_dir = Path(args.out_dir or scratch)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = benchmark(args, backends, out_dir)
    print(format_table(rows, backends[0]))
    if args.json:
        figures = {"backends": backends, "baseline": backends[0]}
        write_json(args.json, figures | {"rows": [asdict(row) for row in rows]}, args)
    return 0 if all(row.status == "ok" for row in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"preset (or model path) to run, dummy weights (default: {DEFAULT_MODEL})",
    )  # fmt: skip
    parser.add_argument(
        "--backends", type=names, default=None, metavar="A,B",
        help="attention backends to run, the first the baseline of the ratios (default: every "
        "registered one able to serve the model here, as `attnserve backends` reports)",
    )  # fmt: skip
    parser.add_argument(
        "--workloads", type=names, default=names(DEFAULT_WORKLOADS), metavar="K1,K2",
        help=f"workload kinds ({', '.join(KINDS)}; {FLAGS_WORKLOAD}: the length flags of "
        f"--extra-args) (default: {DEFAULT_WORKLOADS})",
    )  # fmt: skip
    parser.add_argument(
        "--profile-every", type=int, default=16, metavar="N",
        help="profile one step in N of each run for the attention share (default 16)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds each run may take (default 900)"
    )
    parser.add_argument(
        "--extra-args", default="", metavar="ARGS",
        help='more arguments for every `bench throughput` run, e.g. "--device cpu"',
    )  # fmt: skip
    parser.add_argument("--out-dir", default=None, help="keep each run's JSON and log here")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every row")
    parser.set_defaults(handler=main)
