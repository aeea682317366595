"""Triton kernels of the batched LoRA products (Punica's SGMV shrink and expand): one shrink
and one expand launch per projection (a merged q/k/v or gate/up layer included), for all the
adapters of a step.

A program takes BLOCK_M tokens in `order` (the step's tokens sorted by slot, so a block mostly
holds one adapter) and loops over the slots its tokens use, multiplying only the rows of each
(`tl.dot` tiles):
- shrink: u[t] = x[t] A[s_t]^T in float32 for the S·R columns of every slice, its K (input)
  dimension split over `splits` programs so that a few tokens still spread the read of A over
  the card (one program per K would walk 14,336 inputs alone at batch 1); each split stores its
  partial product, [splits, T, S·R];
- expand: out[t, c] += u[t, slice(c)'s R columns] B[s_t, c]^T, summing the splits as it reads
  u and rounding the sum to B's dtype (tensor-core dots in bf16/fp16, as the torch path);
  `col_slice` [out] names each output column's slice, so one launch covers every slice.
Tokens of slot -1 are skipped (a block of them only: the program returns). The slots and the
order are device tensors read by the kernels, with no host sync, and every allocation depends
only on shapes, so CUDA graphs (whole decode steps and the piecewise ones) capture them with the
slots as an input; the tile sizes and splits depend only on the token count, which a graph
fixes. `punica.add_lora_torch` is their reference (tests run both under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens a program takes (tl.dot's smallest tile)
BLOCK_K = 64  # shrink: inputs a tile
BLOCK_O = 64  # expand: output columns a program
MIN_K_PER_SPLIT = 256  # a shrink program walks at least this many inputs
TARGET_PROGRAMS = 256  # split K until the shrink has about this many programs


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
    x_ptr, a_ptr, idx_ptr, order_ptr, u_ptr, T, N, K, K_PER_SPLIT,
    stride_x, stride_as, stride_an, stride_usplit, stride_u,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows, valid, slots = _block_slots(order_ptr, idx_ptr, T, BLOCK_M)
    last = tl.max(slots, axis=0).to(tl.int64)
    if last >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first = tl.program_id(2) * K_PER_SPLIT
        k_end = tl.minimum(k_first + K_PER_SPLIT, K)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for slot in range(tl.maximum(tl.min(slots, axis=0), 0).to(tl.int64), last + 1):
            mine = valid & (slots == slot)
            a_cols = a_ptr + slot * stride_as + n[None, :] * stride_an
            for k0 in range(k_first, k_end, BLOCK_K):
                k = k0 + ks
                x_mask = mine[:, None] & (k[None, :] < k_end)
                x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=x_mask, other=0)
                a_mask = (k[:, None] < k_end) & (n[None, :] < N)
                a = tl.load(a_cols + k[:, None], mask=a_mask, other=0)
                acc = tl.dot(x, a, acc, input_precision=PRECISION)
        u_at = u_ptr + tl.program_id(2) * stride_usplit + rows[:, None] * stride_u + n[None, :]
        tl.store(u_at, acc, mask=valid[:, None] & (n[None, :] < N))


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    u_ptr, b_ptr, idx_ptr, order_ptr, slice_ptr, out_ptr, T, WIDTH, R, SPLITS,
    stride_usplit, stride_u, stride_bs, stride_bo, stride_out,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    rows, valid, slots = _block_slots(order_ptr, idx_ptr, T, BLOCK_M)
    last = tl.max(slots, axis=0).to(tl.int64)
    if last >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        col_slice = tl.load(slice_ptr + o, mask=o < WIDTH, other=-1)
        first_slice = tl.min(tl.where(o < WIDTH, col_slice, WIDTH), axis=0)
        r = tl.arange(0, BLOCK_R)
        u_mask = valid[:, None] & (slots[:, None] >= 0) & (r[None, :] < R)
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for j in range(first_slice, tl.max(col_slice, axis=0) + 1):
            u_at = u_ptr + rows[:, None] * stride_u + j * R + r[None, :]
            u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in range(0, SPLITS):
                u += tl.load(u_at + split * stride_usplit, mask=u_mask, other=0.0)
            b_mask = (r[:, None] < R) & (col_slice == j)[None, :]
            u = u.to(b_ptr.dtype.element_ty)  # rounded to B's dtype, as the torch path does
            for slot in range(tl.maximum(tl.min(slots, axis=0), 0).to(tl.int64), last + 1):
                mine = tl.where((slots == slot)[:, None], u, 0.0)
                b_rows = b_ptr + slot * stride_bs + o[None, :] * stride_bo
                b = tl.load(b_rows + r[:, None], mask=b_mask, other=0.0)
                acc = tl.dot(mine, b, acc, input_precision=PRECISION)
        out_mask = valid[:, None] & (o[None, :] < WIDTH)
        out_at = out_ptr + rows[:, None] * stride_out + o[None, :]
        base = tl.load(out_at, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_at, (base + acc).to(out_ptr.dtype.element_ty), mask=out_mask)


def _k_splits(blocks: int, in_features: int) -> tuple[int, int]:
    """How many shrink programs share each block's K, and the inputs each walks: enough for
    about TARGET_PROGRAMS in all, each walking at least MIN_K_PER_SPLIT inputs (whole BLOCK_K
    tiles)."""
    tiles = triton.cdiv(in_features, BLOCK_K)
    wanted = max(1, min(triton.cdiv(TARGET_PROGRAMS, blocks), in_features // MIN_K_PER_SPLIT))
    tiles_per_split = triton.cdiv(tiles, wanted)
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split * BLOCK_K


def add_lora_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    col_slice: torch.Tensor,
) -> torch.Tensor:
    """`out` [T, out] with each row's adapter product added in place; `slots`: each token's
    slot and the tokens in slot order; `col_slice`: each output column's slice
    (`layers.column_slices`)."""
    indices, order = slots
    tokens, in_features = x.shape
    rows_a, (width, rank) = lora_a.shape[1], lora_b.shape[1:]
    if x.stride(-1) != 1:
        x = x.contiguous()
    blocks_m = triton.cdiv(tokens, BLOCK_M)
    block_n = min(64, max(16, triton.next_power_of_2(rows_a)))
    blocks_n = triton.cdiv(rows_a, block_n)
    splits, k_per_split = _k_splits(blocks_m * blocks_n, in_features)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    shrunk = torch.empty(splits, tokens, rows_a, dtype=torch.float32, device=x.device)
    _shrink_kernel[(blocks_m, blocks_n, splits)](
        x, lora_a, indices, order, shrunk, tokens, rows_a, in_features, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0), shrunk.stride(1),
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(blocks_m, triton.cdiv(width, BLOCK_O))](
        shrunk, lora_b, indices, order, col_slice, out, tokens, width, rank, splits,
        shrunk.stride(0), shrunk.stride(1), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_O=BLOCK_O,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip
    return out
