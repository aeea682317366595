"""Triton kernels for the model's small elementwise ops: RMSNorm (plain, residual-add, per-head;
Llama's, or Gemma's with `unit_offset`) and the gated activations (SiLU-and-mul, Gemma's GeGLU),
each optionally ending in FP8 per-row quantization for an FP8 linear layer that reads the result
(`rms_norm_fp8`, `silu_and_mul_fp8`); rotary embedding is `fused_rotary`.

Each op replaces a chain of plain torch kernels (casts, pow, mean, rsqrt, muls, ...) by a single
launch, and computes exactly what the plain-torch layer computes, with the same intermediate
roundings: math in float32, the same casts back to the input dtype at the same points, so a bf16
result matches the torch path bitwise or to the last bit (and a quantized one matches the
separate op followed by `fp8.quantize_rows`). The layers (`layernorm`, `activation`) call these
on CUDA and keep their torch code as the CPU path and the reference. Every rounding of a float32
value to a narrower dtype goes through `round_to`, which rounds bf16 to nearest-even with
integer ops: the hardware cast does the same, but Triton's interpreter truncates, and the
kernels must compute the same everywhere.

Launches pass `enable_fp_fusion=False`: torch runs `a * b - c * d` as separate kernels, rounding
each product, so no mul+add may be contracted into an FMA here either.

The kernels are CUDA-graph safe: no host syncs, and every allocation depends only on shapes.
Layout: one program per row (a token, or one head of a token), BLOCK = the next power of two of
the row width, masked. Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1,
set before this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.model.quantization.fp8_format import FP8, Fp8Activation
from attnserve.model.quantization.fp8_quant import store_quantized_row


def warps_for(block: int) -> int:
    """Warps for a program over `block` elements: about 256 elements a warp, 1 to 8."""
    return max(1, min(8, block // 256))


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """`x` [..., N] as a [A, B, N] view with a unit stride on N (a copy only when no such view
    exists): rows are (a, b) pairs, so a [T, H, D] slice of a wider tensor (Qwen3's per-head
    q/k norm on the split of the qkv output) needs no copy."""
    if x.dim() == 0 or x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.reshape(-1, 1, x.shape[-1])


@triton.jit
def round_to(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """float32 `x` rounded to `dtype` (to nearest, ties to even), returned as float32.

    bf16 is rounded with integer ops on the bits (like c10::BFloat16; NaN kept): the GPU's cast
    rounds the same, but Triton's interpreter truncates bf16 casts."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    inner_rows,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    scale_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
) -> None:
    """One row: [sum = x + residual, stored in the residual dtype;] normalise in float32, cast to
    the (summed) input dtype, multiply by the weight; outputs are contiguous [rows, N]. With
    UNIT_OFFSET (Gemma) the scale is 1 + weight and the norm stays in float32 until the product
    is rounded once. With QUANTIZE the product (rounded to the input dtype) is stored in E4M3
    with its row scale."""
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0)
    if HAS_RESIDUAL:
        residual = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols,
            mask=mask,
            other=0,
        )
        # `x + residual` in the sum's dtype (float32 math, one rounding), like torch's add.
        in_dtype = residual_out_ptr.dtype.element_ty
        x32 = round_to(x.to(tl.float32) + residual.to(tl.float32), in_dtype)
        tl.store(residual_out_ptr + row * N + cols, x32.to(in_dtype), mask=mask)
    else:
        in_dtype = x_ptr.dtype.element_ty
        x32 = x.to(tl.float32)
    # torch's CUDA mean multiplies the sum by 1/N: do the same.
    mean_square = tl.sum(x32 * x32, axis=0) * (1.0 / N)
    normed = x32 * tl.math.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0).to(tl.float32)
    if UNIT_OFFSET:
        weight = weight + 1.0
    else:
        normed = round_to(normed, in_dtype)
    if QUANTIZE:
        out = round_to(normed * weight, in_dtype)
        store_quantized_row(out, out_ptr, scale_ptr, row, cols, mask, N)
    else:
        out_dtype = out_ptr.dtype.element_ty
        out = round_to(normed * weight, out_dtype).to(out_dtype)
        tl.store(out_ptr + row * N + cols, out, mask=mask)


@dataclass(frozen=True)
class _NormOutputs:
    out: torch.Tensor  # normed (E4M3 when quantized)
    residual: torch.Tensor | None  # the sum, when a residual was added
    scale: torch.Tensor | None  # the rows' scales, when quantized


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quantize: bool = False,
    unit_offset: bool = False,
) -> _NormOutputs:
    """Shared launcher of the RMSNorm ops; `quantize` stores the output in E4M3 per row,
    `unit_offset` scales by 1 + weight (Gemma; the output in the input's dtype)."""
    n = x.shape[-1]
    rows_x = _rows3(x)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    rows_r = rows_x if residual is None else _rows3(residual)
    norm_in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out_dtype = norm_in_dtype if unit_offset else torch.promote_types(weight.dtype, norm_in_dtype)
    if quantize and (out_dtype != norm_in_dtype or x.dim() != 2):
        raise ValueError("a quantized RMSNorm takes [tokens, hidden] rows in the weight's dtype")
    out = torch.empty(x.shape, dtype=FP8 if quantize else out_dtype, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if quantize else None
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=norm_in_dtype, device=x.device)
    rows = rows_x.shape[0] * rows_x.shape[1]
    if rows == 0:
        return _NormOutputs(out, residual_out, scale)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        rows_x,
        rows_r,
        weight.contiguous(),
        out,
        out if residual_out is None else residual_out,
        rows_x.shape[1],
        rows_x.stride(0),
        rows_x.stride(1),
        rows_r.stride(0),
        rows_r.stride(1),
        out if scale is None else scale,
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=quantize,
        UNIT_OFFSET=unit_offset,
        num_warps=warps_for(block),
        enable_fp_fusion=False,
    )
    return _NormOutputs(out, residual_out, scale)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dimension, the norm in
    float32: `RMSNorm.forward` in one launch. `x` [..., N] may be a strided view (e.g. [T, H, D]
    heads of a wider row); the result is a new contiguous tensor of x's shape, in the dtype torch
    would promote weight and x to. With `unit_offset`, Gemma's `(x * rsqrt(mean(x^2) + eps) *
    (1 + weight)).to(x.dtype)`, all in float32 (`GemmaRMSNorm.forward`)."""
    return _launch_rms_norm(x, None, weight, eps, unit_offset=unit_offset).out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`summed = x + residual` (rounded to their dtype, as torch's add does), then
    `rms_norm(summed, unit_offset=...)`: `RMSNorm.forward_with_residual` in one launch. Returns
    new tensors (normed, summed); the inputs are not modified."""
    outputs = _launch_rms_norm(x, residual, weight, eps, unit_offset=unit_offset)
    assert outputs.residual is not None
    return outputs.out, outputs.residual


def rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[Fp8Activation, torch.Tensor | None]:
    """`rms_norm` (or, with `residual`, `fused_add_rms_norm`) of [T, N] rows in the weight's
    dtype, its output quantized per row as `fp8.quantize_rows` would, in one launch (the
    same values, except that the mean of squares may be summed in another order: a row can
    differ in the norm's last bit, as between any two compilations of the norm). Returns (the
    FP8 rows and their scales, the sum when `residual` was added)."""
    outputs = _launch_rms_norm(x, residual, weight, eps, quantize=True, unit_offset=unit_offset)
    assert outputs.scale is not None
    return Fp8Activation(outputs.out, outputs.scale), outputs.residual


@triton.jit
def _gated_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANTIZE: tl.constexpr,
    GELU_TANH: tl.constexpr,
) -> None:
    """One BLOCK-wide chunk of one row: act(gate) in float32 (silu, or with GELU_TANH torch's
    tanh-approximated gelu), rounded to the input dtype (as torch's activation returns it),
    times up in float32, rounded again (as torch's mul). With QUANTIZE the chunk is the whole
    row, stored in E4M3 with its row scale."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0).to(tl.float32)
    in_dtype = x_ptr.dtype.element_ty
    if GELU_TANH:
        # torch's constants: kBeta = sqrt(2 / pi), kKappa = 0.044715
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        act = round_to(0.5 * gate * (1.0 + tanh), in_dtype)
    else:
        act = round_to(gate / (1.0 + tl.exp(-gate)), in_dtype)
    if QUANTIZE:
        out = round_to(act * up, in_dtype)
        store_quantized_row(out, out_ptr, scale_ptr, row, cols, mask, INTER)
    else:
        out = round_to(act * up, in_dtype).to(in_dtype)
        tl.store(out_ptr + row * INTER + cols, out, mask=mask)


def _launch_gated(
    x: torch.Tensor, quantize: bool, gelu_tanh: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(gate) * up [..., I], its rows' scales when `quantize` (else an empty tensor))."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=FP8 if quantize else x.dtype, device=x.device)
    scale = torch.empty(rows.shape[0] if quantize else 0, dtype=torch.float32, device=x.device)
    if rows.shape[0] == 0 or inter == 0:
        return out, scale
    whole_row = triton.next_power_of_2(inter)
    block = whole_row if quantize else min(1024, whole_row)
    _gated_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows,
        out,
        scale,
        rows.stride(0),
        INTER=inter,
        BLOCK=block,
        QUANTIZE=quantize,
        GELU_TANH=gelu_tanh,
        num_warps=max(warps_for(block), min(16, block // 1024)),
        enable_fp_fusion=False,
    )
    return out, scale


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> silu(gate) * up [..., I], in one launch: `SiluAndMul`."""
    return _launch_gated(x, quantize=False)[0]


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    """`silu_and_mul` of [T, 2*I] rows quantized per row as `fp8.quantize_rows` would (the same
    bits), in one launch."""
    return Fp8Activation(*_launch_gated(x, quantize=True))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> gelu_tanh(gate) * up [..., I] (GeGLU), in one launch:
    `GeluTanhAndMul`. tanh is computed from exp, so a bf16 result can differ from torch's in
    the last bit where the float32 activation lands on a rounding boundary."""
    return _launch_gated(x, quantize=False, gelu_tanh=True)[0]


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> Fp8Activation:
    """`gelu_tanh_and_mul` of [T, 2*I] rows quantized per row, in one launch."""
    return Fp8Activation(*_launch_gated(x, quantize=True, gelu_tanh=True))
