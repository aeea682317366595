"""What `attnserve bench kernels`' backend comparison (bench/kernels.py) and its kernel sweeps
(bench/kernel_sweep.py) share: the dtype, head and block size, the shapes, and the timing:
CUDA events (the host clock off the GPU), replays of a CUDA graph of a call, and the card's
device-to-device copy bandwidth (also the bound's, bench/bound.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
SDPA_BASELINE = "sdpa-contiguous"

# (batch, context length, query heads, kv heads): /work/shared/anchors.md's decode shapes
DECODE_SHAPES = [(64, 2048, 32, 8), (256, 1024, 16, 8), (16, 8192, 32, 8)]
# (batch, prompt length, query heads, kv heads)
PREFILL_SHAPES = [(4, 4096, 32, 8), (16, 1024, 32, 8)]


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


def as_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """Replays of a CUDA graph of `fn` (run twice first: compiles and lazy set-up stay out)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
