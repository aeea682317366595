"""Triton kernel of rotary embedding for an attention layer's q and k in one launch (NeoX
"rotate half"), with the per-head q/k RMSNorm (Qwen3's, or Gemma 3's 1 + weight one) and the copy
of v folded in for the layer's whole qkv split.

It computes what the plain-torch layers compute with the same roundings (`fused_ops`' rules:
float32 math, `round_to` for every narrowing, launches without FMA contraction), so a bf16
result matches the torch path to the last bit. One program per token; CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.model.layers.fused_ops import round_to, warps_for


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
    UNIT_OFFSET: tl.constexpr,
) -> None:
    """Rotate one token's heads [NUM_HEADS, HEAD_SIZE] (contiguous at src_ptr) by cos/sin
    [HALF_PAD] ("rotate half": first' = first*cos - second*sin, second' = second*cos +
    first*sin, in float32) into dst_ptr; with HAS_NORM each head is first RMS-normalised and
    scaled by the weight [HEAD_SIZE] (by 1 + weight with UNIT_OFFSET), rounded as
    `RMSNorm.forward` (`GemmaRMSNorm.forward`) rounds."""
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
        if UNIT_OFFSET:
            first = round_to(first * inv_rms * (w_first[None, :] + 1.0), out_dtype)
            second = round_to(second * inv_rms * (w_second[None, :] + 1.0), out_dtype)
        else:
            first = round_to(round_to(first * inv_rms, out_dtype) * w_first[None, :], out_dtype)
            second = round_to(round_to(second * inv_rms, out_dtype) * w_second[None, :], out_dtype)
    cos = cos[None, :]
    sin = sin[None, :]
    rotated_first = round_to(first * cos - second * sin, out_dtype).to(out_dtype)
    rotated_second = round_to(second * cos + first * sin, out_dtype).to(out_dtype)
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
    UNIT_OFFSET: tl.constexpr,
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
        UNIT_OFFSET,
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
        UNIT_OFFSET,
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
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's q, k, v [T, H*D] (strided splits of its qkv projection) made ready
    for attention in one launch: q and k per-head RMS-normalised when `norm_weights` (q's, k's
    [D], in their dtype; Qwen3's q/k norm, or with `unit_offset` Gemma 3's) are given, then
    rotated as `rotary_embedding` does; v copied. Returns new contiguous tensors."""
    return _launch_rotary(positions, *qkv, cos_sin_cache, head_size, norm_weights, eps, unit_offset)


def _launch_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
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
        UNIT_OFFSET=unit_offset,
        HAS_VALUE=value is not None,
        num_warps=warps_for(max(q_pad, kv_pad) * half_pad),
        enable_fp_fusion=False,
    )
    return q_out, k_out, v_out
