"""`attnserve bench kernels`: every registered attention backend's decode and prefill speed on
the GPU, through the backend API alone, beside the card's copy bandwidth and torch's own
`scaled_dot_product_attention` on contiguous tensors, measured in the same run.

Each backend is driven the same way: `get_kv_cache_shape` for its cache (random bf16, pages
shuffled over the pool), its metadata built once, then `impl.forward` timed with CUDA events
after a warm-up (which also absorbs any just-in-time compilation). Decode runs as the engine runs
it: replays of a CUDA graph of the call, for SDPA and for backends that capture graphs (metadata
from `build_for_cuda_graph`), so the timing is the kernels' and not the host's launch work;
prefill (eager in the engine) runs eagerly. Decode is reported in TB/s of KV
read (K and V of every context token, once) and as a fraction of a device-to-device copy;
prefill in TFLOP/s counting the causal half (2·B·H·L²·D) and as a fraction of SDPA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from attnserve.attention import (
    AttentionBackend,
    AttentionSpec,
    backend_names,
    build_step_layout,
    get_backend_cls,
)
from attnserve.bench.common import check_output_files

HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
SDPA_BASELINE = "sdpa-contiguous"

# (batch, context length, query heads, kv heads): /work/shared/anchors.md's decode shapes
DECODE_SHAPES = [(64, 2048, 32, 8), (256, 1024, 16, 8), (16, 8192, 32, 8)]
# (batch, prompt length, query heads, kv heads)
PREFILL_SHAPES = [(4, 4096, 32, 8), (16, 1024, 32, 8)]


@dataclass
class Row:
    kind: str  # "decode" or "prefill"
    shape: str
    backend: str
    median_us: float | None
    rate: float | None  # TB/s (decode) or TFLOP/s (prefill)
    vs_baseline: float | None  # fraction of the copy bandwidth (decode) or of SDPA (prefill)
    error: str | None = None


def median_us(
    fn: Callable[[], object], calls: int = 10, repeats: int = 10, device: str = DEVICE
) -> float:
    """Median over `repeats` batches of the mean time of `calls` back-to-back calls, in µs
    (CUDA events on a GPU, the host clock elsewhere)."""
    for _ in range(3):
        fn()
    timer = _cuda_batch_us if torch.device(device).type == "cuda" else _host_batch_us
    return statistics.median(timer(fn, calls) for _ in range(repeats))


def _cuda_batch_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def _host_batch_us(fn: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) * 1e6 / calls


def copy_bandwidth_tbs(
    num_bytes: int = 2 << 30, device: str = DEVICE, calls: int = 10, repeats: int = 10
) -> float:
    """Device-to-device copy speed, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), calls, repeats, device)
    return 2 * num_bytes / us / 1e6


def _spec(num_heads: int = 32, num_kv_heads: int = 8) -> AttentionSpec:
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=HEAD_SIZE,
        dtype=DTYPE,
        block_size=BLOCK_SIZE,
        device=DEVICE,
    )


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def _as_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """Replays of a CUDA graph of `fn` (run twice first: compiles and lazy set-up stay out)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _backend_step(
    backend: type[AttentionBackend],
    batch: int,
    context: int,
    query: int,
    heads: tuple[int, int],
) -> Callable[[], object]:
    """A ready-to-time call of `impl.forward` for one step: `batch` sequences, each with
    `context` cached tokens and `query` new ones, on pages shuffled over the pool; a decode
    step (query 1) of a backend that captures graphs is a graph replay."""
    num_heads, num_kv_heads = heads
    pages = -(-(context + query) // BLOCK_SIZE)
    order = torch.randperm(batch * pages).view(batch, pages).tolist()
    shape = backend.get_kv_cache_shape(batch * pages, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)
    cache = _random(*shape)
    builder = backend.get_builder_cls()(_spec(num_heads, num_kv_heads), DEVICE)
    layout = build_step_layout(order, [context] * batch, [query] * batch, BLOCK_SIZE)
    graphed = query == 1 and backend.capabilities.cuda_graphs
    if graphed:
        builder.init_cuda_graph_buffers(batch, pages)
        meta = builder.build_for_cuda_graph(layout)
    else:
        meta = builder.build(layout)
    impl = backend.get_impl_cls()(num_heads, HEAD_SIZE, 1 / math.sqrt(HEAD_SIZE), num_kv_heads)
    tokens = batch * query
    q = _random(tokens, num_heads * HEAD_SIZE)
    k, v = _random(tokens, num_kv_heads * HEAD_SIZE), _random(tokens, num_kv_heads * HEAD_SIZE)
    step = partial(impl.forward, q, k, v, cache, meta)
    return _as_graph(step) if graphed else step


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
    return step if causal else _as_graph(step)


def _measure(step: Callable[[], Callable[[], object]]) -> tuple[float | None, str | None]:
    """(µs, error) of one step; a broken backend is reported, the others still measured."""
    try:
        return median_us(step()), None
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"[:300]
    finally:
        torch.cuda.empty_cache()


def bench_decode(backends: list[str], copy_tbs: float) -> list[Row]:
    """Decode: one new token per sequence over `context` tokens; SDPA reads contiguous KV."""
    rows = []
    for batch, context, num_heads, num_kv_heads in DECODE_SHAPES:
        heads = (num_heads, num_kv_heads)
        kv_bytes = 2 * batch * context * num_kv_heads * HEAD_SIZE * DTYPE.itemsize
        steps = {SDPA_BASELINE: partial(_sdpa_step, batch, context, 1, heads)}
        for name in backends:
            steps[name] = partial(
                _backend_step, get_backend_cls(name), batch, context - 1, 1, heads
            )
        shape = f"{batch}x{context} {num_heads}/{num_kv_heads}"
        for name, step in steps.items():
            us, error = _measure(step)
            tbs = None if us is None else kv_bytes / us / 1e6
            ratio = None if tbs is None else tbs / copy_tbs
            rows.append(Row("decode", shape, name, us, tbs, ratio, error))
    return rows


def bench_prefill(backends: list[str]) -> list[Row]:
    """Causal prefill of whole prompts; SDPA gets K/V expanded to every query head (same
    FLOPs, the fast FlashAttention-2 path)."""
    rows = []
    for batch, length, num_heads, num_kv_heads in PREFILL_SHAPES:
        flops = 2 * batch * num_heads * length * length * HEAD_SIZE
        steps = {SDPA_BASELINE: partial(_sdpa_step, batch, length, length, (num_heads, num_heads))}
        for name in backends:
            heads = (num_heads, num_kv_heads)
            steps[name] = partial(_backend_step, get_backend_cls(name), batch, 0, length, heads)
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


def cuda_backends(requested: list[str] | None) -> list[str]:
    """The requested (default: all registered) backends that can serve the bench's spec here."""
    names = requested or backend_names()
    usable = []
    for name in names:
        try:
            reasons = get_backend_cls(name).unsupported_reasons(_spec())
        except ImportError as error:
            reasons = [f"cannot be imported: {error}"]
        if reasons:
            print(f"skipping {name}: {'; '.join(reasons)}")
        else:
            usable.append(name)
    return usable


def format_table(rows: list[Row], copy_tbs: float) -> str:
    lines = [f"device-to-device copy: {copy_tbs:.2f} TB/s (read + write)"]
    lines.append(f"{'kind':<8} {'shape':<15} {'backend':<16} {'µs':>8} {'rate':>14} {'vs base':>7}")
    for row in rows:
        head = f"{row.kind:<8} {row.shape:<15} {row.backend:<16}"
        if row.error is not None or row.median_us is None or row.rate is None:
            lines.append(f"{head} error: {row.error}")
            continue
        unit = "TB/s" if row.kind == "decode" else "TFLOP/s"
        ratio = f"{row.vs_baseline:.0%}" if row.vs_baseline is not None else "-"
        lines.append(f"{head} {row.median_us:>8.1f} {row.rate:>6.2f} {unit:<7} {ratio:>7}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU; this machine has none")
    check_output_files(args, "json")
    torch.manual_seed(0)
    backends = cuda_backends(args.backends.split(",") if args.backends else None)
    copy_tbs = copy_bandwidth_tbs()
    rows = bench_decode(backends, copy_tbs) + bench_prefill(backends)
    print(format_table(rows, copy_tbs))
    if args.json:
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "dtype": str(DTYPE),
            "head_size": HEAD_SIZE,
            "block_size": BLOCK_SIZE,
            "copy_tbs": copy_tbs,
            "rows": [asdict(row) for row in rows],
        }
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if all(row.error is None for row in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backends", default=None, help="comma-separated backend names (default: all that fit)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write rows as JSON")
    parser.set_defaults(handler=run)
