"""A Triton FP8 GEMM with scales applied in float32: `out = (a * sa) (b * sb)^T`, E4M3 inputs.

`a` [M, K] holds quantized activations, `b` [N, K] a weight (row-major, as the linear layers
keep it). Scales come in one of two granularities:
- row-wise (`group` None): `sa` [M] per token, `sb` [N] per output row; the float32
  accumulator of the whole K loop is scaled once in the epilogue (what `torch._scaled_mm`'s
  row-wise mode computes);
- group-wise (`group` G): `sa` [M, K / G] per token and group of G columns, `sb` [N, K / G]
  per row and group (a block-wise checkpoint's [N / 128, K / 128] scales kept per row); each
  K block's partial product is scaled as it is added (DeepSeek's w8a8 block scheme).

One program computes a BLOCK_M x BLOCK_N tile, programs ordered in groups of GROUP_M row
tiles so that neighbours share the weight tiles in L2. K must be a multiple of BLOCK_K (and
BLOCK_K divide the group), so the K loop needs no masks; rows past M and N are clamped on load
and masked on store. `fp8.fp8_matmul` runs it with the tile `pick_config` picks for M, N and K
(where it is the faster GEMM); other callers may pass a tile or take `default_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@triton.jit
def _scaled_mm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    out_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_a,
    stride_b,
    stride_out,
    stride_a_scale,
    stride_b_scale,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    load_rows = tl.max_contiguous(tl.multiple_of(rows % M, BLOCK_M), BLOCK_M).to(tl.int64)
    load_cols = tl.max_contiguous(tl.multiple_of(cols % N, BLOCK_N), BLOCK_N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + load_rows[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + load_cols[None, :] * stride_b + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K // BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if GROUP_K == 0:
            acc = tl.dot(a, b, acc)
        else:
            group = (k * BLOCK_K) // GROUP_K
            sa = tl.load(a_scale_ptr + load_rows * stride_a_scale + group)
            sb = tl.load(b_scale_ptr + load_cols * stride_b_scale + group)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GROUP_K == 0:
        sa = tl.load(a_scale_ptr + load_rows)
        sb = tl.load(b_scale_ptr + load_cols)
        acc = acc * sa[:, None] * sb[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, block_k: int) -> GemmConfig:
    """A tile shape for M rows (block-wise products: K blocks of `block_k`)."""
    if m <= 16:
        return GemmConfig(16, 64, block_k, 4, 4)
    if m <= 64:
        return GemmConfig(64, 64, block_k, 4, 4)
    return GemmConfig(128, 128, block_k, 8, 4)


def pick_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The tile shape for an [m, k] x [k, n] row-scaled product where this kernel beat
    `torch._scaled_mm`'s row-wise GEMM on the H200 (Llama-3-8B's four projections, M from 1 to
    16,384: docs/benchmarks.md), else None. Up to 64 rows it wins on every shape (by 1.2-1.7x:
    the row-wise GEMM takes ~13 us even for a 4096 x 4096 weight, which takes 4 us to read);
    up to 256 on the narrow ones (N < 16,384); beyond, they tie or the row-wise one wins."""
    wide, deep = n >= 16384, k >= 8192
    if m <= 16:
        config = GemmConfig(16, 128, 128, 4, 4) if wide else GemmConfig(16, 32, 256, 4, 4)
        if m <= 4 and not (wide or deep):
            config = GemmConfig(16, 64, 256, 4, 3)
    elif m <= 64 or (m <= 128 and not wide):
        config = GemmConfig(64, 256, 128, 4, 4) if wide else GemmConfig(64, 64, 256, 4, 3)
    elif m <= 256 and not (wide or deep):
        config = GemmConfig(64, 128, 128, 4, 4)
    else:
        return None
    return config if k % config.block_k == 0 else None


def scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    group: int | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale)^T in `out_dtype` (see the module docstring for the scales'
    shapes); a [M, K] and b [N, K] E4M3 with unit column stride."""
    m, k = a.shape
    n = b.shape[0]
    config = config or default_config(m, min(128, group or 128))
    if k % config.block_k or (group is not None and group % config.block_k):
        raise ValueError(f"fp8 GEMM: K={k} (group {group}) is not a multiple of {config.block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a_scale2 = a_scale.reshape(m, -1)
    b_scale2 = b_scale.reshape(n, -1)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _scaled_mm_kernel[grid](
        a, b, out, a_scale2, b_scale2, m, n, k,
        a.stride(0), b.stride(0), out.stride(0), a_scale2.stride(0), b_scale2.stride(0),
        GROUP_K=group or 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
