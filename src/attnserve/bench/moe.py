"""`attnserve bench moe`: the fused-MoE kernel (`model.layers.fused_moe.fused_experts`: block
alignment, gate+up GEMM with SiLU-and-mul, down GEMM with the routing weights, top-k sum) on one
layer's experts at the real shapes of MoE presets (default: Qwen3-30B-A3B and Mixtral-8x7B) at
decode batch sizes, against the card's ceilings and vLLM's own `fused_experts` (when vLLM is
importable), all measured in the same run.

Per batch size B: hidden states random, router logits random, softmax → top-k (so B tokens route
near-uniformly, as dummy weights do); each call is timed as a CUDA-graph replay (the engine replays
its decode steps). The ceiling of a call is max(weight bytes of the experts it routes to / the
copy rate, 2 · 3 · H · I FLOPs per routed pair / the bf16 matmul rate), both rates measured first
(the copy rate counts bytes read + written, as `bench kernels` does); reported as the fraction of
the ceiling reached. Outputs are checked against the torch reference path (max abs error).
Up to DECODE_MAX_PAIRS routed pairs a second row, `attnserve-decode`, times the matrix-vector
path (`fused_moe_decode.decode_experts`: two launches, no sort) beside the grouped GEMMs (the
`attnserve` row, timed with an explicit config), to check `fused_moe_decode.MAX_PAIRS_PER_EXPERT`,
where the engine switches between them.
`--sweep` also times a grid of kernel tiles at each size (within `--budget-s`), to retune the
tile table of `fused_moe.default_config`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from attnserve.bench.bound import matmul_flops_per_s, moe_spec
from attnserve.bench.common import check_output_files, positive_ints
from attnserve.bench.kernel_common import as_graph, copy_bandwidth_tbs, median_us
from attnserve.model.config import ModelConfig
from attnserve.model.layers.moe import MoESpec
from attnserve.model.layers.ops import moe_reference, select_experts

if TYPE_CHECKING:  # the kernels import Triton: only when a call is made
    from attnserve.model.layers.fused_moe import MoEKernelConfig

Tiles = list[tuple[str, "MoEKernelConfig"]]

SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b")
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
OURS, VLLM, DECODE = "attnserve", "vllm", "attnserve-decode"
DECODE_MAX_PAIRS = 64
SKIPPED = "skipped: time budget spent"


@dataclass(frozen=True)
class Setup:
    """Where and how calls are timed (CPU tests: the interpreter, tiny shapes, no graphs)."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    calls: int = 10
    repeats: int = 10
    graphs: bool = True


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass
class MoeRow:
    shape: str
    batch: int
    impl: str  # attnserve, attnserve-decode, vllm, or a swept tile of attnserve's kernel
    experts_read: int
    ceiling_us: float
    median_us: float | None = None
    max_err: float | None = None
    error: str | None = None

    @property
    def fraction_of_ceiling(self) -> float | None:
        return None if self.median_us is None else self.ceiling_us / self.median_us


@dataclass(frozen=True)
class Inputs:
    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


def expert_spec(preset: str, tensor_parallel_size: int = 1) -> MoESpec:
    """One rank's experts of a preset's sparse layers (intermediate size split over the ranks)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    spec = moe_spec(ModelConfig.resolve(preset, load_format="dummy"))
    if spec is None:
        raise ValueError(f"preset {preset!r} has no experts")
    if spec.intermediate_size % tensor_parallel_size:
        raise ValueError(f"{preset}: {tensor_parallel_size} ranks do not split its experts")
    return replace(spec, intermediate_size=spec.intermediate_size // tensor_parallel_size)


def expert_weights(spec: MoESpec, setup: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(setup.device).manual_seed(0)
    inter, hidden = spec.intermediate_size, spec.hidden_size
    shapes = ((spec.num_experts, 2 * inter, hidden), (spec.num_experts, hidden, inter))
    w13, w2 = (torch.empty(s, dtype=setup.dtype, device=setup.device) for s in shapes)
    return w13.normal_(0, 0.02, generator=gen), w2.normal_(0, 0.02, generator=gen)


def routed_inputs(
    spec: MoESpec,
    weights: tuple[torch.Tensor, torch.Tensor],
    batch: int,
    setup: Setup,
    seed: int | None = None,
) -> Inputs:
    """Random hidden states and router logits for `batch` tokens (seeded by `seed`, else the
    batch size), routed by the spec's top-k."""
    gen = torch.Generator(setup.device).manual_seed(batch if seed is None else seed)
    hidden = torch.randn(batch, spec.hidden_size, generator=gen, device=setup.device)
    logits = torch.randn(batch, spec.num_experts, generator=gen, device=setup.device)
    topk_weights, ids = select_experts(logits, spec.top_k, spec.renormalize)
    return Inputs(hidden.to(setup.dtype), *weights, topk_weights, ids)


def ceiling(spec: MoESpec, inputs: Inputs, rates: Ceilings) -> tuple[int, float]:
    """(experts routed to, the call's ceiling in µs: see the module docstring)."""
    experts = int(inputs.ids.unique().numel())
    expert_params = 3 * spec.hidden_size * spec.intermediate_size
    memory_s = experts * expert_params * inputs.w13.element_size() / rates.copy_bytes_per_s
    compute_s = 2 * inputs.ids.numel() * expert_params / rates.matmul_flops_per_s
    return experts, max(memory_s, compute_s) * 1e6


def _ours(inputs: Inputs, config: MoEKernelConfig | None = None) -> Callable[[], torch.Tensor]:
    from attnserve.model.layers.fused_moe import fused_experts

    i = inputs
    return partial(fused_experts, i.hidden, i.w13, i.w2, i.weights, i.ids, config)


def _decode(inputs: Inputs) -> Callable[[], torch.Tensor]:
    from attnserve.model.layers.fused_moe_decode import decode_experts

    i = inputs
    return partial(decode_experts, i.hidden, i.w13, i.w2, i.weights, i.ids)


def _vllm(inputs: Inputs) -> Callable[[], torch.Tensor]:
    """vLLM's `fused_experts` on the same tensors (ImportError when vLLM is not installed)."""
    from vllm.model_executor.layers.fused_moe import fused_experts

    i = inputs
    ids, weights = i.ids.to(torch.int32), i.weights.float()
    return partial(fused_experts, i.hidden, i.w13, i.w2, weights, ids)


@contextlib.contextmanager
def _vllm_context() -> Iterator[None]:
    """vLLM's default config as the current one (some of its kernels read it), where it has one."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config

        context: contextlib.AbstractContextManager[object] = set_current_vllm_config(VllmConfig())
    except Exception:  # no vLLM (its row says so), or one without this API
        context = contextlib.nullcontext()
    with context:
        yield


def measure(
    make: Callable[[], Callable[[], torch.Tensor]], expected: torch.Tensor, setup: Setup
) -> tuple[float | None, float | None, str | None]:
    """(µs, max abs error against `expected`, error) of one implementation; a failing one is
    reported, the others still measured."""
    try:
        call = make()
        err = float((call().float() - expected.float()).abs().max())
        timed = as_graph(call) if setup.graphs else call
        return median_us(timed, setup.calls, setup.repeats, setup.device), err, None
    except Exception as error:  # an implementation's failure is a row, not the end of the run
        return None, None, f"{type(error).__name__}: {error}"[:300]


def bench_shape(
    name: str,
    spec: MoESpec,
    batches: list[int],
    rates: Ceilings,
    setup: Setup,
    tiles: Tiles | None = None,
    deadline: float = float("inf"),
) -> list[MoeRow]:
    """Every batch size of one shape: attnserve, its decode path (up to DECODE_MAX_PAIRS pairs),
    vLLM, then each of `tiles` (those reached after the monotonic `deadline` are skipped)."""
    weights = expert_weights(spec, setup)
    rows = []
    for batch in batches:
        inputs = routed_inputs(spec, weights, batch, setup)
        expected = moe_reference(inputs.hidden, *weights, inputs.weights, inputs.ids)
        experts, ceiling_us = ceiling(spec, inputs, rates)
        rows.append(MoeRow(name, batch, OURS, experts, ceiling_us))
        rows[-1].median_us, rows[-1].max_err, rows[-1].error = measure(
            partial(_ours, inputs), expected, setup
        )
        if inputs.ids.numel() <= DECODE_MAX_PAIRS:
            rows.append(MoeRow(name, batch, DECODE, experts, ceiling_us))
            rows[-1].median_us, rows[-1].max_err, rows[-1].error = measure(
                partial(_decode, inputs), expected, setup
            )
        with _vllm_context():
            timed = measure(partial(_vllm, inputs), expected, setup)
        rows.append(MoeRow(name, batch, VLLM, experts, ceiling_us, *timed))
        for label, config in tiles or []:
            row = MoeRow(name, batch, label, experts, ceiling_us, error=SKIPPED)
            if time.monotonic() < deadline:
                row.median_us, row.max_err, row.error = measure(
                    partial(_ours, inputs, config), expected, setup
                )
            rows.append(row)
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep_tiles() -> Tiles:
    """Tiles to try: block m × n × k, warps, stages."""
    from attnserve.model.layers.fused_moe import MoEKernelConfig

    tiles = []
    for block_m in (16, 32, 64):
        for block_n in (64, 128):
            for block_k in (64, 128):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    config = MoEKernelConfig(block_m, block_n, block_k, 8, warps, stages)
                    tiles.append((f"{block_m}x{block_n}x{block_k} w{warps} s{stages}", config))
    return tiles


def format_table(rows: list[MoeRow]) -> str:
    lines = [
        f"{'shape':<14} {'batch':>5} {'impl':<22} {'µs':>9} {'experts':>7} "
        f"{'ceiling µs':>10} {'of ceiling':>10} {'vs vLLM':>8} {'max err':>8}"
    ]
    vllm_us = {(r.shape, r.batch): r.median_us for r in rows if r.impl == VLLM}
    for row in rows:
        head = f"{row.shape:<14} {row.batch:>5} {row.impl:<22}"
        if row.median_us is None:
            lines.append(f"{head} error: {row.error}")
            continue
        theirs = vllm_us.get((row.shape, row.batch))
        versus = f"{theirs / row.median_us:.2f}x" if theirs and row.impl != VLLM else "-"
        lines.append(
            f"{head} {row.median_us:>9.1f} {row.experts_read:>7} {row.ceiling_us:>10.1f} "
            f"{row.fraction_of_ceiling:>10.0%} {versus:>8} {row.max_err:>8.2g}"
        )
    return "\n".join(lines)


def best_tiles(rows: list[MoeRow]) -> dict[str, str]:
    """'shape batch' -> the fastest swept tile and its time (rows of `--sweep`)."""
    best: dict[str, tuple[float, str]] = {}
    for row in rows:
        if row.impl in (OURS, DECODE, VLLM) or row.median_us is None:
            continue
        key = f"{row.shape} {row.batch}"
        best[key] = min(best.get(key, (row.median_us, row.impl)), (row.median_us, row.impl))
    return {key: f"{impl} ({us:.1f} µs)" for key, (us, impl) in best.items()}


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench moe needs a CUDA GPU; this machine has none")
    check_output_files(args, "json")
    setup = Setup()
    copy_tbs = copy_bandwidth_tbs()
    rates = Ceilings(copy_tbs * 1e12, matmul_flops_per_s(8192, setup.dtype, "cuda"))
    torch.cuda.empty_cache()
    print(f"copy {copy_tbs:.2f} TB/s, bf16 matmul {rates.matmul_flops_per_s / 1e12:.0f} TFLOP/s")
    deadline = time.monotonic() + args.budget_s
    tiles = sweep_tiles() if args.sweep else None
    specs = {name: expert_spec(name, args.tensor_parallel_size) for name in args.shapes}
    rows: list[MoeRow] = []
    for name, spec in specs.items():
        rows += bench_shape(name, spec, args.batch_sizes, rates, setup, tiles, deadline)
    print(format_table(rows))
    for key, tile in best_tiles(rows).items():
        print(f"best tile, {key}: {tile}")
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "tensor_parallel_size": args.tensor_parallel_size,
            "copy_tbs": copy_tbs,
            "matmul_tflops": rates.matmul_flops_per_s / 1e12,
            "rows": [
                asdict(row) | {"fraction_of_ceiling": row.fraction_of_ceiling} for row in rows
            ],
        }
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if all(r.error is None for r in rows if r.impl == OURS) else 1


def _shapes(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated MoE preset names")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        type=_shapes,
        default=list(SHAPES),
        metavar="PRESET,...",
        help=f"MoE presets whose expert shapes to time (default {','.join(SHAPES)})",
    )
    parser.add_argument(
        "--batch-sizes",
        type=positive_ints,
        default=list(DEFAULT_BATCHES),
        metavar="B1,B2,...",
        help="decode batch sizes (tokens per call; default 1,2,4,...,256)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="time one rank's share of each expert (intermediate size / N; default 1)",
    )
    parser.add_argument("--sweep", action="store_true", help="also time a grid of kernel tiles")
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="time budget of --sweep (default 300)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write rows as JSON")
    parser.set_defaults(handler=run)
