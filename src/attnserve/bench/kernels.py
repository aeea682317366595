"""`attnserve bench kernels`: every registered attention backend's decode and prefill speed on
the GPU, through the backend API alone, beside the card's copy bandwidth and torch's own
`scaled_dot_product_attention` on contiguous tensors, measured in the same run.

Each backend is driven the same way: `get_kv_cache_shape` for its cache (random bf16, or with
`--kv-cache-dtype fp8` random values rounded to e4m3 at unit scales; pages shuffled over the
pool), its metadata built once, then `impl.forward` timed with CUDA events
after a warm-up (which also absorbs any just-in-time compilation). Decode runs as the engine runs
it: replays of a CUDA graph of the call, for SDPA and for backends that capture graphs (metadata
from `build_for_graph`), so the timing is the kernels' and not the host's launch work;
prefill (eager in the engine) runs eagerly. Decode is reported in TB/s of KV
read (K and V of every context token, once, in the cache's own bytes: half of bf16's for fp8;
SDPA's contiguous bf16 K/V stay bf16) and as a fraction of a device-to-device copy;
prefill in TFLOP/s counting the causal half (2·B·H·L²·D) and as a fraction of SDPA.

`--sweep decode,prefill` times tiles and decode split counts of attnserve's own Triton kernels
instead (bench/kernel_sweep.py), on the same shapes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from attnserve.attention import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    backend_names,
    build_step_layout,
    get_backend_cls,
)
from attnserve.bench.common import check_output_files, positive_ints
from attnserve.bench.kernel_common import (
    BLOCK_SIZE,
    DECODE_SHAPES,
    DEVICE,
    DTYPE,
    HEAD_SIZE,
    PREFILL_SHAPES,
    SDPA_BASELINE,
    as_graph,
    copy_bandwidth_tbs,
    median_us,
)
from attnserve.config import KV_CACHE_DTYPES

SWEEPS = ("decode", "prefill")  # what `--sweep` can ask for (bench/kernel_sweep.py)
DEFAULT_SPLITS = (1, 2, 4, 8, 16)


@dataclass
class Row:
    kind: str  # "decode" or "prefill"
    shape: str
    backend: str
    median_us: float | None
    rate: float | None  # TB/s (decode) or TFLOP/s (prefill)
    vs_baseline: float | None  # fraction of the copy bandwidth (decode) or of SDPA (prefill)
    error: str | None = None


def _spec(
    num_heads: int = 32, num_kv_heads: int = 8, kv_cache_dtype: str = "auto"
) -> AttentionSpec:
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
        kv_cache_dtype=kv_cache_dtype,
        block_size=BLOCK_SIZE,
        device=DEVICE,
    )


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def _step_metadata(
    backend: type[AttentionBackend],
    block_tables: list[list[int]],
    context: int,
    query: int,
    heads: tuple[int, int],
    graphed: bool,
    kv_cache_dtype: str,
) -> AttentionMetadata:
    """The backend's metadata for a step of every sequence at `context` cached and `query` new
    tokens, from its builder as the engine drives it (graph buffers for a graphed decode)."""
    builder = backend.get_builder_cls()(_spec(*heads, kv_cache_dtype), DEVICE)
    batch = len(block_tables)
    layout = build_step_layout(block_tables, [context] * batch, [query] * batch, BLOCK_SIZE)
    if graphed:
        builder.init_graph_buffers(batch, len(block_tables[0]))
        return builder.build_for_graph(layout)
    return builder.build(layout)


def _backend_step(
    backend: type[AttentionBackend],
    batch: int,
    context: int,
    query: int,
    heads: tuple[int, int],
    kv_cache_dtype: str,
) -> Callable[[], object]:
    """A ready-to-time call of `impl.forward` for one step: `batch` sequences, each with
    `context` cached tokens and `query` new ones, on pages shuffled over the pool; a decode
    step (query 1) of a backend that captures graphs is a graph replay."""
    num_heads, num_kv_heads = heads
    pages = -(-(context + query) // BLOCK_SIZE)
    order = torch.randperm(batch * pages).view(batch, pages).tolist()
    shape = backend.get_kv_cache_shape(batch * pages, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)
    cache = _random(*shape).to(backend.get_kv_cache_torch_dtype(kv_cache_dtype, DTYPE))
    graphed = query == 1 and backend.capabilities.graphs
    meta = _step_metadata(backend, order, context, query, heads, graphed, kv_cache_dtype)
    impl = backend.get_impl_cls()(
        num_heads, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), num_kv_heads, kv_cache_dtype=kv_cache_dtype
    )
    tokens = batch * query
    q = _random(tokens, num_heads * HEAD_SIZE)
    k, v = _random(tokens, num_kv_heads * HEAD_SIZE), _random(tokens, num_kv_heads * HEAD_SIZE)
    step = partial(impl.forward, q, k, v, cache, meta)
    return as_graph(step) if graphed else step


def _sdpa_step(
    batch: int, length: int, queries: int, heads: tuple[int, int]
) -> Callable[[], object]:
    """SDPA on contiguous [B, H, L, D] tensors; K/V with `heads[1]` heads (GQA when fewer)."""
    num_heads, num_kv_heads = heads
    q = _random(batch, num_heads, queries, HEAD_SIZE)
    k = _random(batch, num_kv_heads, length, HEAD_SIZE)
    v = _random(batch, num_kv_heads, length, HEAD_SIZE)
    causal, gqa = queries > 1, num_kv_heads != num_heads
    step = partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal, enable_gqa=gqa)
    return step if causal else as_graph(step)


def _measure(step: Callable[[], Callable[[], object]]) -> tuple[float | None, str | None]:
    """(µs, error) of one step; a broken backend is reported, the others still measured."""
    try:
        return median_us(step()), None
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"[:300]
    finally:
        torch.cuda.empty_cache()


def bench_decode(backends: list[str], copy_tbs: float, kv_cache_dtype: str = "auto") -> list[Row]:
    """Decode: one new token per sequence over `context` tokens; SDPA reads contiguous KV."""
    rows = []
    cache_bytes = 1 if kv_cache_dtype == "fp8" else DTYPE.itemsize
    for batch, context, num_heads, num_kv_heads in DECODE_SHAPES:
        heads = (num_heads, num_kv_heads)
        kv_elements = 2 * batch * context * num_kv_heads * HEAD_SIZE
        steps = {SDPA_BASELINE: partial(_sdpa_step, batch, context, 1, heads)}
        for name in backends:
            steps[name] = partial(
                _backend_step, get_backend_cls(name), batch, context - 1, 1, heads, kv_cache_dtype
            )
        shape = f"{batch}x{context} {num_heads}/{num_kv_heads}"
        for name, step in steps.items():
            us, error = _measure(step)
            element = DTYPE.itemsize if name == SDPA_BASELINE else cache_bytes
            tbs = None if us is None else kv_elements * element / us / 1e6
            ratio = None if tbs is None else tbs / copy_tbs
            rows.append(Row("decode", shape, name, us, tbs, ratio, error))
    return rows


def bench_prefill(backends: list[str], kv_cache_dtype: str = "auto") -> list[Row]:
    """Causal prefill of whole prompts; SDPA gets K/V expanded to every query head (same
    FLOPs, the fast FlashAttention-2 path)."""
    rows = []
    for batch, length, num_heads, num_kv_heads in PREFILL_SHAPES:
        flops = 2 * batch * num_heads * length * length * HEAD_SIZE
        steps = {SDPA_BASELINE: partial(_sdpa_step, batch, length, length, (num_heads, num_heads))}
        for name in backends:
            heads = (num_heads, num_kv_heads)
            steps[name] = partial(
                _backend_step, get_backend_cls(name), batch, 0, length, heads, kv_cache_dtype
            )
        shape = f"{batch}x{length} {num_heads}/{num_kv_heads}"
        sdpa_tflops = None
        for name, step in steps.items():
            us, error = _measure(step)
            tflops = None if us is None else flops / us / 1e6
            if name == SDPA_BASELINE:
                sdpa_tflops = tflops
            ratio = None if tflops is None or sdpa_tflops is None else tflops / sdpa_tflops
            rows.append(Row("prefill", shape, name, us, tflops, ratio, error))
    return rows


def cuda_backends(requested: list[str] | None, kv_cache_dtype: str = "auto") -> list[str]:
    """The requested (default: all registered) backends that can serve the bench's spec here."""
    names = requested or backend_names()
    usable = []
    for name in names:
        try:
            reasons = get_backend_cls(name).unsupported_reasons(
                _spec(kv_cache_dtype=kv_cache_dtype)
            )
        except ImportError as error:
            reasons = [f"cannot be imported: {error}"]
        if reasons:
            print(f"skipping {name}: {'; '.join(reasons)}")
        else:
            usable.append(name)
    return usable


def format_table(rows: list[Row]) -> str:
    lines = [f"{'kind':<8} {'shape':<15} {'backend':<16} {'µs':>8} {'rate':>14} {'vs base':>7}"]
    for row in rows:
        head = f"{row.kind:<8} {row.shape:<15} {row.backend:<16}"
        if row.error is not None or row.median_us is None or row.rate is None:
            lines.append(f"{head} error: {row.error}")
            continue
        unit = "TB/s" if row.kind == "decode" else "TFLOP/s"
        ratio = f"{row.vs_baseline:.0%}" if row.vs_baseline is not None else "-"
        lines.append(f"{head} {row.median_us:>8.1f} {row.rate:>6.2f} {unit:<7} {ratio:>7}")
    return "\n".join(lines)


def _compare_backends(args: argparse.Namespace, copy_tbs: float) -> tuple[list[Any], bool]:
    """(rows, every row measured) of the backend comparison."""
    dtype = args.kv_cache_dtype
    backends = cuda_backends(args.backends.split(",") if args.backends else None, dtype)
    rows = bench_decode(backends, copy_tbs, dtype) + bench_prefill(backends, dtype)
    print(format_table(rows))
    return rows, all(row.error is None for row in rows)


def _sweep_kernels(args: argparse.Namespace, copy_tbs: float) -> tuple[list[Any], bool]:
    """(rows, every default configuration checked and timed) of the kernel sweeps."""
    from attnserve.bench.kernel_sweep import Setup, format_sweep, run_sweeps

    setup = Setup(kv_cache_dtype=args.kv_cache_dtype, atol=args.atol)
    rows = run_sweeps(args.sweep, args.splits, args.budget_s, copy_tbs, setup)
    print(format_sweep(rows))
    return rows, all(row.status == "ok" for row in rows if row.default)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU; this machine has none")
    check_output_files(args, "json")
    torch.manual_seed(0)
    copy_tbs = copy_bandwidth_tbs()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s (read + write)")
    rows, ok = (_sweep_kernels if args.sweep else _compare_backends)(args, copy_tbs)
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "dtype": str(DTYPE),
            "kv_cache_dtype": args.kv_cache_dtype,
            "head_size": HEAD_SIZE,
            "block_size": BLOCK_SIZE,
            "copy_tbs": copy_tbs,
            "rows": [asdict(row) for row in rows],
        }
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if ok else 1


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name for name in text.split(",") if name]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {allowed}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backends", default=None, help="comma-separated backend names (default: all that fit)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write rows as JSON")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default="auto",
        help="the backends' cache: auto (bf16) or fp8 (decode rates in fp8 bytes; the sweeps "
        "take it too)",
    )
    parser.add_argument(
        "--sweep",
        type=_choices(SWEEPS),
        default=None,
        metavar="decode,prefill",
        help="instead of comparing backends, sweep the tiles and decode split counts of "
        "attnserve's own Triton kernels (bench/kernel_sweep.py)",
    )
    parser.add_argument(
        "--splits",
        type=positive_ints,
        default=list(DEFAULT_SPLITS),
        metavar="N,N,...",
        help="decode split counts the decode sweep times at the default tile (default 1,2,4,8,16)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=190.0, help="time budget of the sweeps (default 190)"
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=0.05,
        help="a sweep run whose max abs error against fp32 attention exceeds this is not timed",
    )
    parser.set_defaults(handler=run)
