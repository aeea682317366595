"""Triton kernels of the batched LoRA products (Punica's BGMV shrink and expand): one launch
each per projection for all the adapters of a step, every token reading its own slot.

shrink: u[t, n] = x[t] · A[s_t, n] (float32) for the S·R rows of A; expand: out[t, o] +=
u[t, col_slice[o]·R : +R] · B[s_t, o]. A token whose slot is -1 is skipped. The kernels read the
per-token slots from a device tensor and make no host sync, and every allocation depends only
on shapes, so CUDA graphs (whole decode steps and the piecewise ones) capture them with the
slots as an input. `punica.add_lora_torch` is their reference (tests run both under Triton's
interpreter on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    a_ptr,
    idx_ptr,
    u_ptr,
    N,
    K,
    stride_xt,
    stride_as,
    stride_an,
    stride_ut,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(idx_ptr + t)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + n[:, None] * stride_an
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
            mask = (n[:, None] < N) & (k[None, :] < K)
            a = tl.load(a_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(u_ptr + t * stride_ut + n, acc, mask=n < N)


@triton.jit
def _expand_kernel(  # type: ignore[no-untyped-def]
    u_ptr,
    b_ptr,
    idx_ptr,
    col_slice_ptr,
    out_ptr,
    OUT,
    R,
    stride_ut,
    stride_bs,
    stride_bo,
    stride_ot,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(idx_ptr + t)
    if slot >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        r = tl.arange(0, BLOCK_R)
        mask = (o[:, None] < OUT) & (r[None, :] < R)
        part = tl.load(col_slice_ptr + o, mask=o < OUT, other=0)
        u = tl.load(u_ptr + t * stride_ut + part[:, None] * R + r[None, :], mask=mask, other=0.0)
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + o[:, None] * stride_bo
        b = tl.load(b_rows + r[None, :], mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(u * b, axis=1)
        out_at = out_ptr + t * stride_ot + o
        base = tl.load(out_at, mask=o < OUT, other=0.0).to(tl.float32)
        tl.store(out_at, (base + delta).to(out_ptr.dtype.element_ty), mask=o < OUT)


def add_lora_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    col_slice: torch.Tensor,
) -> torch.Tensor:
    """`out` [T, out] with each row's adapter product added in place (see the module)."""
    tokens, in_features = x.shape
    rows_a, rank = lora_a.shape[1], lora_b.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    shrunk = torch.empty(tokens, rows_a, dtype=torch.float32, device=x.device)
    block_n = min(triton.next_power_of_2(rows_a), 64)
    _shrink_kernel[(tokens, triton.cdiv(rows_a, block_n))](
        x, lora_a, indices, shrunk, rows_a, in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    block_o = 64
    _expand_kernel[(tokens, triton.cdiv(out.shape[1], block_o))](
        shrunk, lora_b, indices, col_slice, out, out.shape[1], rank,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_O=block_o, BLOCK_R=triton.next_power_of_2(rank),
    )  # fmt: skip
    return out
