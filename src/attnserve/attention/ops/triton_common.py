"""The pieces the Triton attention kernels share: launch parameters, tile configs, K/V loads
from the paged cache, and the online-softmax step over one key tile (general and plain causal).

Scores are kept in the log2 domain (exp2 is the fast path): soft-cap first, then ALiBi, then
masking, as the contract defines. Cache layout: see `triton_cache`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttentionParams:
    """What every attention kernel launch needs beyond the tensors."""

    scale: float
    sliding_window: int | None = None
    alibi_slopes: torch.Tensor | None = None  # [num_heads] fp32, on the kernel's device
    soft_cap: float | None = None
    kv_scales: torch.Tensor | None = None  # fp8 caches: [2, KV heads] fp32 (None: all 1.0)


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.float8_e4m3fn


def fp8_mode(kv_cache: torch.Tensor, query: torch.Tensor) -> int:
    """The decode kernel's FP8 constexpr: 0 for a cache of another dtype; 2 for an fp8 cache read
    by a half-precision query (which the kernel turns to fp16) on a GPU with e4m3 pair
    conversions (sm_89+: `load_kv` converts value tiles before their layout change); 1 for any
    other fp8 case (Triton's own casts)."""
    if not is_fp8(kv_cache):
        return 0
    if query.is_cuda and query.dtype != torch.float32:
        return 2 if _converts_e4m3_pairs(query.device) else 1
    return 1


@functools.lru_cache(maxsize=8)
def _converts_e4m3_pairs(device: torch.device) -> bool:
    """Whether a CUDA device has `cvt.rn.f16x2.e4m3x2` (sm_89+), asked once per device: every
    decode launch outside a graph replay asks again."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def scales_operand(
    kv_scales: torch.Tensor | None, kv_cache: torch.Tensor, placeholder: torch.Tensor
) -> torch.Tensor:
    """The kernels' `scales_ptr`: an fp8 cache's [2, KV heads] scales (all 1.0 where none are
    given); for a cache of another dtype `placeholder`, which the kernels never read."""
    if not is_fp8(kv_cache):
        return placeholder
    if kv_scales is not None:
        return kv_scales
    return torch.ones(2, kv_cache.shape[2], dtype=torch.float32, device=kv_cache.device)


@triton.jit
def load_scales(scales_ptr, kv_head, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr):  # type: ignore[no-untyped-def]
    """(k_scale, v_scale) of one KV head of an fp8 cache; (1.0, 1.0) for other caches."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(scales_ptr + kv_head)
        v_scale = tl.load(scales_ptr + NUM_KV_HEADS + kv_head)
    return k_scale, v_scale


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of one kernel. block_m (query rows per program) is the
    prefill kernel's; the decode kernel's rows are one GQA group, padded to 16."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit
def load_kv(  # type: ignore[no-untyped-def]
    cache_ptr,
    table_ptr,
    k_pos,
    valid,
    head_offset,
    dims,
    dim_mask,
    stride_block,
    stride_kv,
    HEAD_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """K and V [N, D] of the keys at `k_pos` from the paged cache, in DTYPE; unpredicated
    loads when the tile is unmasked and the head size a power of two."""
    if MASKED:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    else:
        blocks = tl.load(table_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
    rows = blocks * stride_block + head_offset + (k_pos % BLOCK_SIZE) * HEAD_SIZE
    ptrs = cache_ptr + rows[:, None] + dims[None, :]
    if not MASKED and EVEN_D:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_kv)
    else:
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(ptrs, mask=kv_mask, other=0)
        v = tl.load(ptrs + stride_kv, mask=kv_mask, other=0)
    if FP8:
        k = k.to(tl.float8e4nv, bitcast=True)
        # FP8 2: DTYPE is fp16 (fp8_mode)
        v = _e4m3_bytes_to_f16(v) if FP8 == 2 else v.to(tl.float8e4nv, bitcast=True)
    return k.to(DTYPE), v.to(DTYPE)


@triton.jit
def _e4m3_bytes_to_f16(x):  # type: ignore[no-untyped-def]
    """e4m3 bytes -> fp16 by the hardware's pair conversion, in the layout the bytes were
    loaded in. A value tile is the B operand of P @ V, whose layout wants consecutive keys, a
    head's size apart in the cache: with Triton's cast the compiler moves the layout change
    before the conversion and reads the 8-bit tile from shared memory a byte at a time (sm_90
    has no 8-bit ldmatrix transpose). Declared impure so that it stays put: the tile is
    converted as loaded (16-byte reads) and its fp16 copy takes the transposing ldmatrix."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4,
    )  # fmt: skip


@triton.jit
def attend_tile(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    slopes,
    k_pos,
    valid,
    cache_ptr,
    table_ptr,
    head_offset,
    dims,
    dim_mask,
    window,
    sm_scale,
    soft_cap,
    stride_block,
    stride_kv,
    HEAD_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold the keys at `k_pos` [N] of one sequence (one KV head) into the online-softmax state
    (acc [M, D], running max m_i and sum l_i [M], log2 units) of the queries q [M, D] at q_pos.

    MASK: 0 none, 1 only `valid` (keys past the range), 2 causal + `valid` + sliding window.
    EVEN_D: the head size is a power of two (no padded dims to mask).
    Scores: soft-cap, then ALiBi, then the mask. Dots are exact fp32 when DOT_FP32 (fp32 models,
    and the CPU interpreter, whose low-precision dots are unreliable)."""
    k, v = load_kv(
        cache_ptr, table_ptr, k_pos, valid, head_offset, dims, dim_mask, stride_block,
        stride_kv, HEAD_SIZE, EVEN_D, BLOCK_SIZE, MASK != 0, FP8, q.dtype,
    )  # fmt: skip
    if DOT_FP32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if USE_SOFTCAP:
        x = qk * (sm_scale / soft_cap)
        tanh = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
        s = tanh * (soft_cap * 1.4426950408889634)
    else:
        s = qk * (sm_scale * 1.4426950408889634)
    if USE_ALIBI:
        distance = (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        s += (slopes * 1.4426950408889634)[:, None] * distance
    if MASK == 1:
        s = tl.where(valid[None, :], s, float("-inf"))
    if MASK == 2:
        allowed = (k_pos[None, :] <= q_pos[:, None]) & valid[None, :]
        if USE_WINDOW:
            allowed &= q_pos[:, None] - k_pos[None, :] < window
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def attend_plain_tile(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    allowed,
    qk_scale,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold K/V [N, D] into the online softmax of plain causal attention (qk_scale: softmax
    scale times log2(e), applied in the multiply-add that subtracts the running maximum; P @ V
    accumulates in place). Every row's running maximum is finite from its first tile on (a query
    tile's first key tile starts at key 0), so no guard against an all -inf row."""
    if DOT_FP32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i
