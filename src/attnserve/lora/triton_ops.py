"""Triton kernels of the batched LoRA products (Punica's SGMV shrink and expand): one shrink
launch per layer and one expand launch per projection of it (q, k and v of a merged layer
each), for all the adapters of a step.

A program takes BLOCK_M tokens in `order` (the step's tokens sorted by slot, so a block mostly
holds one adapter) and loops over the slots its tokens use, multiplying only the rows of each
(`tl.dot` tiles): shrink u[t] = x[t] A[s_t]^T (float32, the S·R columns of every slice), expand
out[t, slice] += u[t, slice's R columns] B[s_t, slice rows]^T. Tokens of slot -1 are skipped
(a block of them only: the program returns). The slots and the order are device tensors read by
the kernels, with no host sync, and every allocation depends only on shapes, so CUDA graphs
(whole decode steps and the piecewise ones) capture them with the slots as an input; the tile
sizes do not depend on the token count, so the warm-up compiles every kernel a graph replays.
`punica.add_lora_torch` is their reference (tests run both under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens a program takes (tl.dot's smallest tile)


@triton.jit
def _block_slots(order_ptr, idx_ptr, T, BLOCK_M: tl.constexpr):  # type: ignore[no-untyped-def]
    """The block's token rows (in slot order), whether each is a token, and their slots."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs < T
    rows = tl.load(order_ptr + offs, mask=valid, other=0).to(tl.int64)
    slots = tl.load(idx_ptr + rows, mask=valid, other=-1)
    return rows, valid, slots


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr, a_ptr, idx_ptr, order_ptr, u_ptr, T, N, K,
    stride_x, stride_as, stride_an, stride_u,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows, valid, slots = _block_slots(order_ptr, idx_ptr, T, BLOCK_M)
    last = tl.max(slots, axis=0).to(tl.int64)
    if last >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for slot in range(tl.maximum(tl.min(slots, axis=0), 0).to(tl.int64), last + 1):
            mine = valid & (slots == slot)
            a_cols = a_ptr + slot * stride_as + n[None, :] * stride_an
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                x_mask = mine[:, None] & (k[None, :] < K)
                x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=x_mask, other=0)
                a_mask = (k[:, None] < K) & (n[None, :] < N)
                a = tl.load(a_cols + k[:, None], mask=a_mask, other=0)
                acc = tl.dot(x, a, acc, input_precision=PRECISION)
        u_mask = valid[:, None] & (n[None, :] < N)
        tl.store(u_ptr + rows[:, None] * stride_u + n[None, :], acc, mask=u_mask)


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    u_ptr, b_ptr, idx_ptr, order_ptr, out_ptr, T, WIDTH, R,
    stride_u, stride_bs, stride_bo, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows, valid, slots = _block_slots(order_ptr, idx_ptr, T, BLOCK_M)
    last = tl.max(slots, axis=0).to(tl.int64)
    if last >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        r = tl.arange(0, BLOCK_R)
        u_mask = valid[:, None] & (slots[:, None] >= 0) & (r[None, :] < R)
        u = tl.load(u_ptr + rows[:, None] * stride_u + r[None, :], mask=u_mask, other=0.0)
        b_mask = (r[:, None] < R) & (o[None, :] < WIDTH)
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for slot in range(tl.maximum(tl.min(slots, axis=0), 0).to(tl.int64), last + 1):
            mine = tl.where((slots == slot)[:, None], u, 0.0)
            b_rows = b_ptr + slot * stride_bs + o[None, :] * stride_bo
            b = tl.load(b_rows + r[:, None], mask=b_mask, other=0.0).to(tl.float32)
            acc = tl.dot(mine, b, acc, input_precision="ieee")
        out_mask = valid[:, None] & (o[None, :] < WIDTH)
        out_at = out_ptr + rows[:, None] * stride_out + o[None, :]
        base = tl.load(out_at, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_at, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def add_lora_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    spans: list[tuple[int, int]],
) -> torch.Tensor:
    """`out` [T, out] with each row's adapter product added in place; `slots`: each token's
    slot and the tokens in slot order; `spans`: each slice's (first output column, width)."""
    indices, order = slots
    tokens, in_features = x.shape
    rows_a, rank = lora_a.shape[1], lora_b.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    shrunk = torch.empty(tokens, rows_a, dtype=torch.float32, device=x.device)
    blocks_m = triton.cdiv(tokens, BLOCK_M)
    block_n = min(64, max(16, triton.next_power_of_2(rows_a)))
    _shrink_kernel[(blocks_m, triton.cdiv(rows_a, block_n))](
        x, lora_a, indices, order, shrunk, tokens, rows_a, in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    block_r = max(16, triton.next_power_of_2(rank))
    for j, (start, width) in enumerate(spans):
        _expand_kernel[(blocks_m, triton.cdiv(width, 64))](
            shrunk[:, j * rank :], lora_b[:, start:], indices, order, out[:, start:],
            tokens, width, rank,
            shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_O=64, BLOCK_R=block_r,
        )  # fmt: skip
    return out
