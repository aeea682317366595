"""Triton kernels for the model's small elementwise ops: RMSNorm (plain, residual-add, per-head),
rotary embedding of q and k in one launch (with Qwen3's per-head q/k norm and the copy of v
folded in, for an attention layer's whole qkv), and SiLU-and-mul.

Each op replaces a chain of plain torch kernels (casts, pow, mean, rsqrt, muls, cat, ...) by a
single launch, and computes exactly what the plain-torch layer computes, with the same
intermediate roundings: math in float32, the same casts back to the input dtype at the same
points, so a bf16 result matches the torch path bitwise or to the last bit. The layers
(`layernorm`, `rotary_embedding`, `activation`) call these on CUDA and keep their torch code as
the CPU path and the reference. Every rounding of a float32 value to a narrower dtype goes
through `_round`, which rounds bf16 to nearest-even with integer ops: the hardware cast does the
same, but Triton's interpreter truncates, and the kernels must compute the same everywhere.

Launches pass `enable_fp_fusion=False`: torch runs `a * b - c * d` as separate kernels, rounding
each product, so no mul+add may be contracted into an FMA here either.

The kernels are CUDA-graph safe: no host syncs, and every allocation depends only on shapes.
Layout: one program per row (a token, or one head of a token), BLOCK = the next power of two of
the row width, masked. Without a GPU they run through Triton's interpreter (TRITON_INTERPRET=1,
set before this module is imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
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
def _round(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
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
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
) -> None:
    """One row: [sum = x + residual, stored in the residual dtype;] normalise in float32, cast to
    the (summed) input dtype, multiply by the weight; outputs are contiguous [rows, N]."""
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
        x32 = _round(x.to(tl.float32) + residual.to(tl.float32), in_dtype)
        tl.store(residual_out_ptr + row * N + cols, x32.to(in_dtype), mask=mask)
    else:
        in_dtype = x_ptr.dtype.element_ty
        x32 = x.to(tl.float32)
    # torch's CUDA mean multiplies the sum by 1/N: do the same.
    mean_square = tl.sum(x32 * x32, axis=0) * (1.0 / N)
    normed = _round(x32 * tl.math.rsqrt(mean_square + eps), in_dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * N + cols, _round(normed * weight, out_dtype).to(out_dtype), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared launcher of `rms_norm` / `fused_add_rms_norm`."""
    n = x.shape[-1]
    rows_x = _rows3(x)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    rows_r = rows_x if residual is None else _rows3(residual)
    norm_in_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(
        x.shape, dtype=torch.promote_types(weight.dtype, norm_in_dtype), device=x.device
    )
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=norm_in_dtype, device=x.device)
    rows = rows_x.shape[0] * rows_x.shape[1]
    if rows == 0:
        return out, residual_out
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
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_num_warps(block),
        enable_fp_fusion=False,
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dimension, the norm in
    float32: `RMSNorm.forward` in one launch. `x` [..., N] may be a strided view (e.g. [T, H, D]
    heads of a wider row); the result is a new contiguous tensor of x's shape, in the dtype torch
    would promote weight and x to."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`summed = x + residual` (rounded to their dtype, as torch's add does), then
    `rms_norm(summed)`: `RMSNorm.forward_with_residual` in one launch. Returns new tensors
    (normed, summed); the inputs are not modified."""
    out, summed = _launch_rms_norm(x, residual, weight, eps)
    assert summed is not None
    return out, summed


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    cos,
    sin,
    weight_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
) -> None:
    """Rotate one token's heads [NUM_HEADS, HEAD_SIZE] (contiguous at src_ptr) by cos/sin
    [HALF_PAD] ("rotate half": first' = first*cos - second*sin, second' = second*cos +
    first*sin, in float32) into dst_ptr; with HAS_NORM each head is first RMS-normalised and
    scaled by the weight [HEAD_SIZE], rounded as `RMSNorm.forward` rounds."""
    half: tl.constexpr = HEAD_SIZE // 2
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < half)[None, :]
    offsets = heads[:, None] * HEAD_SIZE + dims[None, :]
    first = tl.load(src_ptr + offsets, mask=mask, other=0).to(tl.float32)
    second = tl.load(src_ptr + offsets + half, mask=mask, other=0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    if HAS_NORM:
        squares = tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)
        inv_rms = tl.math.rsqrt(squares * (1.0 / HEAD_SIZE) + eps)[:, None]
        w_first = tl.load(weight_ptr + dims, mask=dims < half, other=0).to(tl.float32)
        w_second = tl.load(weight_ptr + half + dims, mask=dims < half, other=0).to(tl.float32)
        first = _round(_round(first * inv_rms, out_dtype) * w_first[None, :], out_dtype)
        second = _round(_round(second * inv_rms, out_dtype) * w_second[None, :], out_dtype)
    cos = cos[None, :]
    sin = sin[None, :]
    rotated_first = _round(first * cos - second * sin, out_dtype).to(out_dtype)
    rotated_second = _round(second * cos + first * sin, out_dtype).to(out_dtype)
    tl.store(dst_ptr + offsets, rotated_first, mask=mask)
    tl.store(dst_ptr + offsets + half, rotated_second, mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    query_out_ptr,
    key_out_ptr,
    value_out_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    eps,
    stride_query,
    stride_key,
    stride_value,
    stride_cos_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_VALUE: tl.constexpr,
) -> None:
    """One token: gather its cos/sin row, rotate all its query heads, then all its key heads
    (each head normalised first with HAS_NORM); with HAS_VALUE, copy its value row out too."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half: tl.constexpr = HEAD_SIZE // 2
    dims = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + position * stride_cos_sin
    cos = tl.load(row + dims, mask=dims < half, other=0).to(tl.float32)
    sin = tl.load(row + half + dims, mask=dims < half, other=0).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_query,
        query_out_ptr + token * (NUM_Q_HEADS * HEAD_SIZE),
        cos,
        sin,
        q_weight_ptr,
        eps,
        NUM_Q_HEADS,
        Q_HEADS_PAD,
        HEAD_SIZE,
        HALF_PAD,
        HAS_NORM,
    )
    _rotate_heads(
        key_ptr + token * stride_key,
        key_out_ptr + token * (NUM_KV_HEADS * HEAD_SIZE),
        cos,
        sin,
        k_weight_ptr,
        eps,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HEAD_SIZE,
        HALF_PAD,
        HAS_NORM,
    )
    if HAS_VALUE:
        width: tl.constexpr = NUM_KV_HEADS * HEAD_SIZE
        cols = tl.arange(0, KV_PAD)
        v = tl.load(value_ptr + token * stride_value + cols, mask=cols < width)
        tl.store(value_out_ptr + token * width + cols, v, mask=cols < width)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [T, ...] as [T, width] with a unit inner stride (a view of a split when possible)."""
    x = x.flatten(1)
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX "rotate half" rotary embedding of query [T, Hq*D] and key [T, Hkv*D] by their
    tokens' positions [T], in one launch: `RotaryEmbedding.forward`. `cos_sin_cache`
    [max_position, D] holds cos then sin (D/2 each) per position, in float32; the rotation is
    computed in float32 and cast to each input's dtype. Returns new contiguous tensors (q, k)
    shaped [T, H*D]; the inputs are not modified (they may be strided splits of a qkv row)."""
    q_out, k_out, _ = _launch_rotary(positions, query, key, None, cos_sin_cache, head_size)
    return q_out, k_out


def qkv_rotary_embedding(
    positions: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's q, k, v [T, H*D] (strided splits of its qkv projection) made ready
    for attention in one launch: q and k per-head RMS-normalised when `norm_weights` (q's, k's
    [D], in their dtype; Qwen3's q/k norm) are given, then rotated as `rotary_embedding` does;
    v copied. Returns new contiguous tensors."""
    return _launch_rotary(positions, *qkv, cos_sin_cache, head_size, norm_weights, eps)


def _launch_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens = query.shape[0]
    q_rows, k_rows = _token_rows(query), _token_rows(key)
    v_rows = k_rows if value is None else _token_rows(value)
    q_out = torch.empty(q_rows.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(k_rows.shape, dtype=key.dtype, device=key.device)
    v_out = (
        k_out
        if value is None
        else torch.empty(v_rows.shape, dtype=value.dtype, device=value.device)
    )
    if num_tokens == 0:
        return q_out, k_out, v_out
    num_q_heads = q_rows.shape[1] // head_size
    num_kv_heads = k_rows.shape[1] // head_size
    half_pad = triton.next_power_of_2(head_size // 2)
    q_pad = triton.next_power_of_2(num_q_heads)
    kv_pad = triton.next_power_of_2(num_kv_heads)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_weight, k_weight = norm_weights or (cache, cache)
    _rotary_kernel[(num_tokens,)](
        positions.contiguous(),
        q_rows,
        k_rows,
        v_rows,
        q_out,
        k_out,
        v_out,
        cache,
        q_weight.contiguous(),
        k_weight.contiguous(),
        eps,
        q_rows.stride(0),
        k_rows.stride(0),
        v_rows.stride(0),
        cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=q_pad,
        KV_HEADS_PAD=kv_pad,
        HEAD_SIZE=head_size,
        HALF_PAD=half_pad,
        KV_PAD=triton.next_power_of_2(v_rows.shape[1]),
        HAS_NORM=norm_weights is not None,
        HAS_VALUE=value is not None,
        num_warps=_num_warps(max(q_pad, kv_pad) * half_pad),
        enable_fp_fusion=False,
    )
    return q_out, k_out, v_out


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    stride_x,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """One BLOCK-wide chunk of one row: silu(gate) in float32, rounded to the input dtype (as
    torch's silu returns it), times up in float32, rounded again (as torch's mul)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), x_ptr.dtype.element_ty)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * INTER + cols, _round(silu * up, out_dtype).to(out_dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> silu(gate) * up [..., I], in one launch: `SiluAndMul`."""
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows,
        out,
        rows.stride(0),
        INTER=inter,
        BLOCK=block,
        num_warps=_num_warps(block),
        enable_fp_fusion=False,
    )
    return out
