"""The fused-MoE path for decode sizes: a handful of tokens, each routed pair's expert read as a
matrix-vector product, with no sort and no padding.

At a few tokens over many experts (Qwen3-30B-A3B's batch 1: 8 pairs, 8 experts of 128) the
grouped GEMMs of `fused_moe` spend a 16-row `tl.dot` on one real row, and a step pays for the
sort (`align_block_size`), its fill, the per-pair output and the top-k sum: five launches and one
program per (expert block, column block), too few to keep every SM streaming weights. Here:

1. gate+up: program (pair, column block) reads its expert's BLOCK_N gate and up rows of `w13`
   [E, 2·I, H] against the pair's token row, and stores `silu(gate) · up` (float32 math, one
   rounding) at the pair's row of the intermediate [pairs, I];
2. down: program (token, column block) walks the token's top-k pairs, multiplies each pair's
   intermediate row by its expert's BLOCK_N rows of `w2` [E, H, I], scales by the routing weight,
   and sums them in float32: the token's output [T, H], rounded once.

Two launches, every weight row read once per pair that routes to it (at decode sizes pairs
rarely share an expert), and enough programs to fill the card. `attnserve bench moe` times it
beside the grouped GEMMs (its `attnserve-decode` rows); `fused_moe.fused_experts` takes this
path up to MAX_PAIRS_PER_EXPERT routed pairs per expert, where it is ahead on an H100
(docs/benchmarks.md, MoE section). CUDA-graph safe: the grids depend only on the number of
tokens and the shapes. Without a GPU the kernels run through Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The decode path wins where pairs rarely share an expert: on the H100 (2026-12-05) it took
# Qwen3-30B-A3B's 8 / 16 / 32 pairs over 128 experts in 0.80 / 0.84 / 0.97x the grouped GEMMs'
# time and Mixtral-8x7B's 2 pairs over 8 in 1.02x, but 32 pairs over 8 in 2.1x.
MAX_PAIRS_PER_EXPERT = 0.25


@dataclass(frozen=True)
class DecodeMoEConfig:
    """Tile sizes and launch settings of the two matrix-vector kernels. The defaults are the
    fastest of a tile sweep on an H100 (2026-12-05) at Qwen3-30B-A3B's and Mixtral-8x7B's shapes,
    1 to 4 tokens: narrow down tiles with long K tiles, as the down kernel's K loop runs top_k
    times per program."""

    block_n_gate_up: int = 16
    block_k_gate_up: int = 256
    block_n_down: int = 4
    block_k_down: int = 512
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n_gate_up", "block_k_gate_up", "block_n_down", "block_k_down"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"DecodeMoEConfig.{name} must be a power of two, got {value}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("DecodeMoEConfig.num_warps and num_stages must be >= 1")


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """out[pair, cols] = silu(gate · x) · (up · x) for the pair's token row x and its expert's
    gate rows `cols` and up rows N + `cols`."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_x
    gate_rows = w_ptr + expert * stride_we + cols[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        x = tl.load(x_row + k0 + ks, mask=k_mask, other=0).to(tl.float32)[None, :]
        mask = col_mask[:, None] & k_mask[None, :]
        gate += tl.load(gate_rows + (k0 + ks)[None, :], mask=mask, other=0).to(tl.float32) * x
        up += tl.load(up_rows + (k0 + ks)[None, :], mask=mask, other=0).to(tl.float32) * x
    gate_sum = tl.sum(gate, axis=1)
    act = gate_sum / (1.0 + tl.exp(-gate_sum)) * tl.sum(up, axis=1)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + pair.to(tl.int64) * stride_out + cols, act.to(out_dtype), mask=col_mask)


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    """out[token, cols] = Σ over the token's pairs of weight · (w2[expert] rows `cols`) · a[pair],
    in float32, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w_ptr + expert * stride_we + cols[:, None] * stride_wn
        a_row = a_ptr + pair * stride_a
        part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a = tl.load(a_row + k0 + ks, mask=k_mask, other=0).to(tl.float32)[None, :]
            mask = col_mask[:, None] & k_mask[None, :]
            part += tl.load(rows + (k0 + ks)[None, :], mask=mask, other=0).to(tl.float32) * a
        total += tl.load(weights_ptr + pair).to(tl.float32) * tl.sum(part, axis=1)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + token * stride_out + cols, total.to(out_dtype), mask=col_mask)


def decode_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: DecodeMoEConfig | None = None,
) -> torch.Tensor:
    """`fused_moe.fused_experts` for a few tokens (shapes checked by the caller): hidden [T, H],
    w13 [E, 2·I, H], w2 [E, H, I], topk_weights and topk_ids [T, top_k] -> [T, H]."""
    config = config or DecodeMoEConfig()
    (num_tokens, top_k), inter, size = topk_ids.shape, w2.shape[2], hidden.shape[1]
    ids = topk_ids.flatten().contiguous()
    intermediate = torch.empty(ids.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    grid = (ids.numel(), triton.cdiv(inter, config.block_n_gate_up))
    _gate_up_kernel[grid](
        hidden, w13, ids, intermediate, inter, size,
        hidden.stride(0), w13.stride(0), w13.stride(1), intermediate.stride(0),
        TOP_K=top_k, BLOCK_N=config.block_n_gate_up, BLOCK_K=config.block_k_gate_up, **launch,
    )  # fmt: skip
    out = torch.empty_like(hidden)
    grid = (num_tokens, triton.cdiv(size, config.block_n_down))
    _down_kernel[grid](
        intermediate, w2, ids, topk_weights.flatten().contiguous(), out, size, inter,
        intermediate.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=config.block_n_down, BLOCK_K=config.block_k_down, **launch,
    )  # fmt: skip
    return out
