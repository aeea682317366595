"""Host time of one attention-backend call at the kernel bench's decode shapes (GPU).

`attnserve bench kernels` times back-to-back `impl.forward` calls, so a call whose host work
(Python, argument handling, launches) outlasts its kernels measures the host. This prints, per
shape and backend, the host µs of a forward (no sync between calls) beside its device µs, the
host µs of each piece the TRITON forward launches, and the top of a cProfile of the forwards.

    PYTHONPATH=src:. python3 scripts/launch_overhead.py [--backends TRITON]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Callable

import torch

from attnserve.attention.registry import get_backend_cls
from attnserve.bench.kernels import DECODE_SHAPES, _backend_step, median_us


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Mean host time of `fn` over `calls` calls queued without waiting for the GPU."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def profile_top(fn: Callable[[], object], calls: int = 200, lines: int = 18) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="TRITON")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.backends.split(","):
        backend = get_backend_cls(name)
        for batch, context, heads, kv_heads in DECODE_SHAPES:
            step = _backend_step(backend, batch, context - 1, 1, (heads, kv_heads))
            print(f"{name} decode {batch}x{context}: host {host_us(step):.1f} µs/call, "
                  f"back-to-back {median_us(step):.1f} µs/call", flush=True)  # fmt: skip
        step = _backend_step(backend, 64, 2047, 1, (32, 8))
        print(profile_top(step), flush=True)


if __name__ == "__main__":
    main()
