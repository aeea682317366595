"""The fused-MoE Triton kernels: every routed (token, expert) pair through its expert's gated MLP
in two grouped GEMMs, with the routing weights applied in the second.

The pairs are sorted by expert into blocks of BLOCK_M rows (`fused_moe_routing.align_block_size`:
each expert's pairs padded to a whole number of blocks, so a block belongs to one expert), then:

1. gate+up: each program takes one block and BLOCK_N columns of the expert's intermediate size,
   multiplies the block's token rows by the gate and the up rows of `w13` [E, 2·I, H] in one pass
   over H, and stores `silu(gate) · up` (float32 math, one rounding) at the pair's row of the
   intermediate [pairs, I];
2. down: the same blocks multiply the intermediate rows by the expert's `w2` [E, H, I], scale each
   row by its pair's routing weight, and store it at the pair's row of [pairs, H];

and torch sums the top-k rows of each token (float32 accumulation, one rounding). Weights are read
once per block, so at decode sizes (a few pairs per expert) the kernels stream each routed
expert's weights once: the memory-bound ceiling. Programs are ordered in groups of GROUP_M blocks
along the columns, so neighbouring programs share an expert's weight tiles in L2.

CUDA-graph safe: no host syncs, and every buffer's size depends only on the number of tokens,
top-k, the expert count and BLOCK_M (the padded length is an upper bound; blocks past the real
end exit at once). In float32 the dots run in IEEE precision (no TF32). Without a GPU the kernels
run through Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.model.layers.fused_moe_decode import MAX_PAIRS_PER_EXPERT, decode_experts
from attnserve.model.layers.fused_moe_routing import AlignedRoutes, align_block_size


@dataclass(frozen=True)
class MoEKernelConfig:
    """Tile sizes and launch settings of both GEMMs (BLOCK_M is also the alignment)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(
                    f"MoEKernelConfig.{name} must be a power of two >= 16, got {value}"
                )
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError("MoEKernelConfig.group_m, num_warps and num_stages must be >= 1")


# (largest mean number of pairs per expert, config): decode sizes get small row blocks and long
# K tiles (weight streaming), prefill sizes larger row blocks.
_CONFIGS = (
    (16, MoEKernelConfig(16, 64, 128, num_stages=4)),
    (48, MoEKernelConfig(32, 64, 128, num_stages=3)),
    (192, MoEKernelConfig(64, 64, 64, num_stages=4)),
)
_LARGE = MoEKernelConfig(128, 64, 64, num_warps=8, num_stages=3)


def default_config(num_pairs: int, num_experts: int) -> MoEKernelConfig:
    """The tiles for `num_pairs` routed pairs over `num_experts` experts."""
    mean_rows = num_pairs / max(num_experts, 1)
    return next((config for rows, config in _CONFIGS if mean_rows <= rows), _LARGE)


@triton.jit
def _moe_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    num_blocks_m,
    stride_a,
    stride_be,
    stride_bn,
    stride_out,
    PAIRS_PER_A_ROW: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
) -> None:
    """One block of BLOCK_M sorted pairs × BLOCK_N output columns: out[pair] = A[pair row] ·
    B[expert]ᵀ (GATED: silu(A·gateᵀ) · (A·upᵀ), up = B's rows N..2N), × the pair's weight
    (WEIGHTED). A row of A is pair // PAIRS_PER_A_ROW (the token, for the hidden states)."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pairs // PAIRS_PER_A_ROW)[:, None] * stride_a
    b_cols = b_ptr + expert * stride_be + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=valid[:, None] & k_mask[None, :], other=0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        b = tl.load(b_cols + (k0 + ks)[:, None], mask=b_mask, other=0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            up = tl.load(b_cols + N * stride_bn + (k0 + ks)[:, None], mask=b_mask, other=0)
            acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_out + cols[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptrs, acc.to(out_dtype), mask=valid[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    routes: AlignedRoutes,
    weights: torch.Tensor | None,
    pairs_per_a_row: int,
    config: MoEKernelConfig,
) -> None:
    """Launch `_moe_gemm_kernel` over every block of `routes` (see its docstring); gated when
    `b` holds two rows (gate, up) per output column."""
    gated = b.shape[1] == 2 * out.shape[1]
    num_cols, num_blocks_m = out.shape[1], routes.block_experts.numel()
    grid = (num_blocks_m * triton.cdiv(num_cols, config.block_n),)
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        out if weights is None else weights,
        routes.sorted_pairs,
        routes.block_experts,
        routes.num_padded,
        num_cols,
        a.shape[1],
        out.shape[0],
        num_blocks_m,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATED=gated,
        WEIGHTED=weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoEKernelConfig | None = None,
) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2·I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights and
    topk_ids [T, top_k] -> Σ over each token's top-k of weight · w2[e] · (silu(gate_e·x) ·
    up_e·x), [T, H] in hidden's dtype. (Under tensor parallelism I is this rank's share and the
    result a partial sum, to be all-reduced.) With no `config` and at most MAX_PAIRS_PER_EXPERT
    routed pairs per expert, the matrix-vector path of `fused_moe_decode` runs instead."""
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    if w13.shape[1] != 2 * inter or not w13.shape[2] == hidden.shape[1] == w2.shape[1]:
        raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} do not match")
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    num_pairs = num_tokens * top_k
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    if config is None and num_pairs <= MAX_PAIRS_PER_EXPERT * num_experts:
        return decode_experts(hidden, w13, w2, topk_weights, topk_ids)
    config = config or default_config(num_pairs, num_experts)
    routes = align_block_size(topk_ids, num_experts, config.block_m)
    intermediate = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, intermediate, routes, None, top_k, config)
    per_pair = torch.empty(num_pairs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.flatten().contiguous()
    _grouped_gemm(intermediate, w2, per_pair, routes, weights, 1, config)
    return per_pair.view(num_tokens, top_k, -1).sum(1)
