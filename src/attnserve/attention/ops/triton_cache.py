"""Triton KV-cache write (vLLM's reshape_and_cache): new keys/values into their cache slots.

The cache layout is [num_blocks, 2, num_kv_heads, block_size, head_size] (K plane, then V
plane of each block; within a plane each KV head's page is contiguous). A slot of -1 is
padding and is never written. An fp8 cache stores value / scale in e4m3 (saturated; one
scale per KV head, `KVCacheScales`), viewed as bytes: on the GPU through the hardware's
conversion, under the Triton interpreter (which rounds fp8 casts wrongly) through integer ops
that compute the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnserve.attention.ops.triton_common import is_fp8, load_scales, scales_operand


@triton.jit(do_not_specialize=["num_tokens"])  # a new token count needs no new compile
def _reshape_and_cache_kernel(  # type: ignore[no-untyped-def]
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    num_tokens,
    stride_key_tok,
    stride_value_tok,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_head,
    stride_cache_slot,
    scales_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
    HW_CAST: tl.constexpr,
) -> None:
    head = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    written = (slots >= 0)[:, None] & (dims < HEAD_SIZE)[None, :]
    rows = (slots // BLOCK_SIZE) * stride_cache_block + head * stride_cache_head
    dst = cache_ptr + (rows + (slots % BLOCK_SIZE) * stride_cache_slot)[:, None] + dims[None, :]
    src = tokens.to(tl.int64)[:, None]
    key = tl.load(key_ptr + src * stride_key_tok + head * HEAD_SIZE + dims[None, :], mask=written)
    value = tl.load(
        value_ptr + src * stride_value_tok + head * HEAD_SIZE + dims[None, :], mask=written
    )
    if FP8:
        k_scale, v_scale = load_scales(scales_ptr, head, NUM_KV_HEADS, FP8)
        key = _to_fp8_bytes(key.to(tl.float32) * (1.0 / k_scale), HW_CAST)
        value = _to_fp8_bytes(value.to(tl.float32) * (1.0 / v_scale), HW_CAST)
    tl.store(dst, key, mask=written)
    tl.store(dst + stride_cache_kv, value, mask=written)


@triton.jit
def _to_fp8_bytes(x, HW_CAST: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 -> e4m3fn bit pattern (round to nearest even, saturating at +-448): the hardware's
    conversion with HW_CAST, else integer ops (for the interpreter, whose fp8 casts round
    wrongly) that give the same bits."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if HW_CAST:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exponent = mag >> 23
    sticky = ((mag & 0x7FFFF) != 0).to(tl.int32)
    round_up = ((mag >> 19) & 1) & (sticky | ((mag >> 20) & 1))
    normal = (((exponent - 120) << 3) | ((mag >> 20) & 7)) + round_up
    scaled = tl.abs(x) * 512.0  # subnormals: multiples of 2^-9
    nearest = tl.floor(scaled + 0.5)
    odd = nearest - 2.0 * tl.floor(nearest * 0.5) == 1.0
    nearest = tl.where((nearest - scaled == 0.5) & odd, nearest - 1.0, nearest)
    code = tl.where(exponent >= 121, normal, nearest.to(tl.int32))
    return (code | sign).to(tl.uint8)


def cache_storage(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels address it: fp8 caches are handled as raw bytes."""
    return kv_cache.view(torch.uint8) if is_fp8(kv_cache) else kv_cache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, Hkv, D] into `kv_cache` [num_blocks, 2, Hkv, block_size, D] at
    `slot_mapping` [T] (flat slot = block * block_size + offset; -1 = skip); an fp8 cache
    stores them divided by `kv_scales` [2, Hkv] (keys' row, values' row; None: 1.0). The cache
    may be a strided view (FlashAttention's [.., block_size, Hkv, D] blocks, transposed) as long
    as each head's row of D values is contiguous."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if key.stride()[1:] != (head_size, 1) or value.stride()[1:] != (head_size, 1):
        raise ValueError("key/value must be contiguous within each token's heads")
    storage = cache_storage(kv_cache)
    if storage.stride(4) != 1:
        raise ValueError("the cache's head_size axis must be contiguous")
    block_t = 16 if key.is_cuda else 128  # the CPU interpreter's cost is per program
    grid = (triton.cdiv(num_tokens, block_t), num_kv_heads)
    _reshape_and_cache_kernel[grid](
        key,
        value,
        storage,
        slot_mapping,
        num_tokens,
        key.stride(0),
        value.stride(0),
        storage.stride(0),
        storage.stride(1),
        storage.stride(2),
        storage.stride(3),
        scales_operand(kv_scales, kv_cache, slot_mapping),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_T=block_t,
        FP8=is_fp8(kv_cache),
        HW_CAST=key.is_cuda,
    )
