"""One Triton launch for FP8's per-token activation quantization on CUDA (`fp8.quantize_rows`
in torch takes eight: float cast, abs, amax, divide, clamp, divide, clamp, cast).

A program per row: the row's max |x| gives its scale (max times 1/448, as torch computes a
division by a scalar, at least float32's smallest normal), then x / scale (correctly rounded
division, as torch's by a tensor), clamped to +-448, cast to E4M3 (round to nearest even, as
torch's cast). The same values as the torch path, so the FP8 linear layer computes the same on
either. `store_quantized_row` is that quantization as a kernel's last step: the fused RMSNorm and
SiLU-and-mul kernels (`fused_ops`) end with it to hand an FP8 layer its input ready.
`quantize_groups` does the same per row and group of columns (block-wise FP8 layers), a program
per row, its scales written column-major, as cuBLAS's block-scaled GEMM reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.model.quantization import fp8_format

# the format's constants, as Triton kernels may read globals (constexpr only)
FP8_MAX = tl.constexpr(fp8_format.FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / fp8_format.FP8_MAX)
_MIN_SCALE = tl.constexpr(fp8_format.MIN_SCALE)


@triton.jit
def _quantized(y, AXIS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Float32 `y` quantized along AXIS: (its values divided by their scale and clamped to the
    E4M3 range, the scales: max |y| / 448, at least float32's smallest normal)."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=AXIS) * _INV_FP8_MAX, _MIN_SCALE)
    scaled = tl.math.div_rn(y, tl.expand_dims(scale, AXIS))
    return tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX), scale


@triton.jit
def store_quantized_row(y, out_ptr, scale_ptr, row, cols, mask, K):  # type: ignore[no-untyped-def]
    """Row `row` of float32 values `y` (0 where masked) quantized: E4M3 at out_ptr[row, cols]
    (rows of K), its scale at scale_ptr[row]. The fused norm and activation kernels end with it."""
    scaled, scale = _quantized(y, 0)
    tl.store(out_ptr + row * K + cols, scaled.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quantize_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0).to(tl.float32)
    store_quantized_row(x, out_ptr, scale_ptr, row, cols, mask, K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], float32 scales [M]) with x ~ q * scale per row."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    num_rows, width = rows.shape
    out = torch.empty(num_rows, width, dtype=fp8_format.FP8, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(width)
        _quantize_rows_kernel[(num_rows,)](
            rows, out, scale, rows.stride(0), K=width, BLOCK=block,
            num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return out, scale


@triton.jit
def _quantize_groups_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    scale_ptr,
    num_rows,
    stride_x,
    stride_scale_group,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, GROUPS_PAD)
    cols = tl.arange(0, GROUP_PAD)
    in_k = groups < K // GROUP
    mask = in_k[:, None] & (cols < GROUP)[None, :]
    offsets = groups[:, None] * GROUP + cols[None, :]
    loaded = groups < tl.where(row < num_rows, K // GROUP, 0)  # rows past num_rows: all zero
    load_mask = loaded[:, None] & (cols < GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_x + offsets, mask=load_mask, other=0).to(tl.float32)
    scaled, scale = _quantized(x, 1)
    tl.store(out_ptr + row * K + offsets, scaled.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row + groups * stride_scale_group, scale, mask=in_k)


def quantize_groups(
    x: torch.Tensor, group: int, row_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M', K], float32 scales [M', K / group]) with x ~ q * scale per row and
    group of `group` columns (`group` divides K). M' is M rounded up to `row_multiple`;
    the rows past M are zero (scale: the smallest one). The scales are column-major (a column
    per group): cuBLAS's 1 x 128 block scaling wants them so."""
    rows = x if x.stride(-1) == 1 else x.contiguous()
    num_rows, width = rows.shape
    padded = -(-num_rows // row_multiple) * row_multiple
    groups = width // group
    out = torch.empty(padded, width, dtype=fp8_format.FP8, device=x.device)
    scale = torch.empty(groups, padded, dtype=torch.float32, device=x.device)
    if padded:
        group_pad, groups_pad = triton.next_power_of_2(group), triton.next_power_of_2(groups)
        _quantize_groups_kernel[(padded,)](
            rows, out, scale, num_rows, rows.stride(0), scale.stride(0),
            K=width, GROUP=group, GROUP_PAD=group_pad, GROUPS_PAD=groups_pad,
            num_warps=max(1, min(16, groups_pad * group_pad // 1024)),
        )  # fmt: skip
    return out, scale.t()
