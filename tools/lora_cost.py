"""What the LoRA products add to one decode token on the GPU, kernel time and launches together.

    PYTHONPATH=src python tools/lora_cost.py [--layers 32] [--rank 16] [--tokens 1]

Builds every projection of a Llama-3-8B-shaped model (merged q/k/v, o, merged gate/up, down;
bf16) with one rank-R adapter in slot 0, records one CUDA graph of all their `add_lora_triton`
calls (two launches each) and one of the base GEMMs, replays each and prints microseconds per
token: the adapters' cost beside the base weights' (`bench latency --enable-lora` measures the
same end to end). With `--sweep`, it also times the kernels' tunables (shrink programs, expand
columns a program, warps) to show whether the cost is in the kernels' work or in their count.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

import attnserve.lora.triton_ops as ops

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
PROJECTIONS = [  # (input features, output slices)
    (HIDDEN, [HIDDEN, KV, KV]),
    (HIDDEN, [HIDDEN]),
    (HIDDEN, [INTERMEDIATE, INTERMEDIATE]),
    (INTERMEDIATE, [HIDDEN]),
]


def projection(tokens: int, rank: int, inputs: int, widths: list[int]) -> dict[str, Any]:
    """One projection's input, output, adapter buffers (2 slots) and base weight on cuda."""
    width = sum(widths)

    def bf16(*shape: int, scale: float = 0.01) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale

    col_slice = [torch.full((w,), j, dtype=torch.int32) for j, w in enumerate(widths)]
    return {
        "x": bf16(tokens, inputs, scale=1.0),
        "out": torch.zeros(tokens, width, device="cuda", dtype=torch.bfloat16),
        "lora_a": bf16(2, len(widths) * rank, inputs),
        "lora_b": bf16(2, width, rank),
        "col_slice": torch.cat(col_slice).cuda(),
        "weight": bf16(width, inputs),
    }


def graph_microseconds(body: Callable[[], None], replays: int = 50) -> float:
    """Best of three mean replay times of a CUDA graph of `body`."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - started) / replays)
    return best * 1e6


class WithWarps:
    """A Triton kernel launched with `warps` warps (the kernels' launch sites set none)."""

    def __init__(self, kernel: Any, warps: int) -> None:
        self.kernel, self.warps = kernel, warps

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.kernel[grid](*args, num_warps=self.warps, **kwargs)


def sweep(lora: Callable[[], None]) -> None:
    shrink, expand = ops._shrink_kernel, ops._expand_kernel
    defaults = ops.TARGET_PROGRAMS, ops.BLOCK_O
    grid = itertools.product([64, 256], [64, 128], [1, 4], [2, 4])
    for programs, block_o, shrink_warps, expand_warps in grid:
        ops.TARGET_PROGRAMS, ops.BLOCK_O = programs, block_o
        ops._shrink_kernel = WithWarps(shrink, shrink_warps)
        ops._expand_kernel = WithWarps(expand, expand_warps)
        print(
            f"  shrink programs ~{programs:<4} expand columns {block_o:<4} "
            f"warps {shrink_warps}/{expand_warps}: {graph_microseconds(lora):7.0f} us"
        )
    ops._shrink_kernel, ops._expand_kernel = shrink, expand
    ops.TARGET_PROGRAMS, ops.BLOCK_O = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' tunables")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/lora_cost.py needs a CUDA GPU")
    layers = [
        projection(args.tokens, args.rank, inputs, widths)
        for _ in range(args.layers)
        for inputs, widths in PROJECTIONS
    ]
    slot = torch.zeros(args.tokens, dtype=torch.int32, device="cuda")
    order = torch.arange(args.tokens, dtype=torch.int32, device="cuda")

    def lora() -> None:
        for p in layers:
            ops.add_lora_triton(
                p["x"], p["out"], (slot, order), p["lora_a"], p["lora_b"], p["col_slice"]
            )

    def base() -> None:
        for p in layers:
            torch.matmul(p["x"], p["weight"].t(), out=p["out"])

    launches = 2 * len(layers)
    print(f"{args.layers} layers, {args.tokens} token(s), rank {args.rank}, bf16:")
    print(f"  base GEMMs ({len(layers)} launches): {graph_microseconds(base):7.0f} us")
    print(f"  LoRA products ({launches} launches): {graph_microseconds(lora):7.0f} us")
    if args.sweep:
        sweep(lora)


if __name__ == "__main__":
    main()
