"""Triton paged prefill attention: prompts and chunked prefills over their cached context.

The new tokens' K/V are already in the cache (written by `triton_cache` first), so every key is
read from the paged cache. One program computes BLOCK_M query rows of one sequence: BLOCK_M /
GROUP_PAD consecutive tokens times every query head of one KV head (a GQA group), so each K/V
tile is loaded once per group; an online softmax runs over BLOCK_N-key tiles (tensor-core
dots). Key tiles that no mask touches (before the tile's first token, inside every row's
window) run without mask code; the rest (the causal diagonal, the window's edge) are masked.
The window's edge loop exists only when a window is set. Page ids are loaded once per key row
(an L1-resident int32 per row of HEAD_SIZE elements), never per element.

Two structural switches, `PrefillVariant`, let a sweep (scripts/sweep_triton_prefill.py)
compare them on the GPU:
- `global_heavy_first`: a 1-D grid ordered so that the causally longest query tiles of every
  (sequence, KV head) launch before any shorter one (longest-processing-time-first over the
  whole launch, the smallest tail); otherwise each (sequence, KV head) runs its tiles longest
  first in turn (neighbouring programs share K/V in L2).
- `fused_softmax` (plain causal attention only: no window, ALiBi or soft-cap): the log2-domain
  softmax scale is applied in the same multiply-add that subtracts the running maximum, and
  P @ V accumulates in place into the rescaled accumulator (`tl.dot(p, v, acc)`), instead of
  the shared `attend_tile`'s separate scale multiply and accumulator add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnserve.attention.ops.triton_cache import cache_storage
from attnserve.attention.ops.triton_decode import (
    AttentionParams,
    KernelConfig,
    attend_tile,
    load_kv,
)


@dataclass(frozen=True)
class PrefillVariant:
    """Structural switches of the prefill kernel (see the module docstring)."""

    global_heavy_first: bool = False
    fused_softmax: bool = True


@triton.jit
def _program_coordinates(  # type: ignore[no-untyped-def]
    num_q_tiles,
    num_seqs,
    NUM_KV_HEADS: tl.constexpr,
    GLOBAL_HEAVY_FIRST: tl.constexpr,
):
    """(query tile, sequence, KV head) of this program of the 1-D grid; the last query tiles
    (the most keys under the causal mask) get the lowest program ids."""
    pid = tl.program_id(0)
    if GLOBAL_HEAVY_FIRST:
        rank = pid // (num_seqs * NUM_KV_HEADS)
        pair = pid % (num_seqs * NUM_KV_HEADS)
    else:
        rank = pid % num_q_tiles
        pair = pid // num_q_tiles
    return num_q_tiles - 1 - rank, pair // NUM_KV_HEADS, pair % NUM_KV_HEADS


@triton.jit
def _attend_tile_fused(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_pos,
    valid,
    cache_ptr,
    table_ptr,
    head_offset,
    dims,
    dim_mask,
    qk_scale,
    stride_block,
    stride_kv,
    HEAD_SIZE: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """`attend_tile` for plain causal attention (qk_scale: softmax scale times log2(e)).
    Every row's running maximum is finite from its first tile on (the first key tile of a
    query tile starts at or before its first token), so no guard against an all -inf row."""
    k, v = load_kv(
        cache_ptr, table_ptr, k_pos, valid, head_offset, dims, dim_mask, stride_block,
        stride_kv, HEAD_SIZE, EVEN_D, BLOCK_SIZE, MASKED, FP8, q.dtype,
    )  # fmt: skip
    if DOT_FP32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if MASKED:
        allowed = (k_pos[None, :] <= q_pos[:, None]) & valid[None, :]
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


@triton.jit
def _attend_range(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    slopes,
    cache_ptr,
    table,
    head_offset,
    dims,
    dim_mask,
    start,
    end,
    seq_len,
    window,
    sm_scale,
    soft_cap,
    stride_block,
    stride_kv,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FUSED_SOFTMAX: tl.constexpr,
):
    """Fold key tiles [start, end) into the running softmax state of one query tile."""
    for tile in range(start, end, BLOCK_N):
        k_pos = tile + tl.arange(0, BLOCK_N)
        if FUSED_SOFTMAX:
            acc, m_i, l_i = _attend_tile_fused(
                acc, m_i, l_i, q, q_pos, k_pos, k_pos < seq_len, cache_ptr, table, head_offset,
                dims, dim_mask, sm_scale * 1.4426950408889634, stride_block, stride_kv, HEAD_SIZE,
                HEAD_PAD == HEAD_SIZE, BLOCK_SIZE, MASKED, FP8, DOT_FP32,
            )  # fmt: skip
        else:
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, slopes, k_pos, k_pos < seq_len, cache_ptr, table,
                head_offset, dims, dim_mask, window, sm_scale, soft_cap, stride_block,
                stride_kv, HEAD_SIZE, HEAD_PAD == HEAD_SIZE, BLOCK_SIZE, 2 if MASKED else 0,
                USE_WINDOW, USE_ALIBI, USE_SOFTCAP, FP8, DOT_FP32,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_q_tiles", "num_seqs", "stride_table", "window"])
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    slopes_ptr,
    out_ptr,
    num_q_tiles,
    num_seqs,
    stride_q_tok,
    stride_out_tok,
    stride_table,
    stride_block,
    stride_kv,
    stride_head,
    sm_scale,
    soft_cap,
    v_scale,
    window,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GLOBAL_HEAVY_FIRST: tl.constexpr,
    FUSED_SOFTMAX: tl.constexpr,
) -> None:
    q_tile, seq, kv_head = _program_coordinates(
        num_q_tiles, num_seqs, NUM_KV_HEADS, GLOBAL_HEAVY_FIRST
    )
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if q_tile * (BLOCK_M // GROUP_PAD) >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - query_len + q_tile * (BLOCK_M // GROUP_PAD)  # the tile's first token
    last_pos = first_pos + BLOCK_M // GROUP_PAD - 1

    rows = tl.arange(0, BLOCK_M)  # row r: token r // GROUP_PAD, query head r % GROUP_PAD
    token = q_tile * (BLOCK_M // GROUP_PAD) + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    heads = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE
    io_mask = ((token < query_len) & (head_in_group < GROUP))[:, None] & dim_mask[None, :]
    tokens = (query_start + token).to(tl.int64)
    q_offsets = tokens[:, None] * stride_q_tok + heads[:, None] * HEAD_SIZE + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    q_pos = first_pos + rows // GROUP_PAD
    slopes = (
        tl.load(slopes_ptr + heads, mask=head_in_group < GROUP, other=0.0) if USE_ALIBI else None
    )

    hi = tl.minimum(seq_len, last_pos + 1)
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head * stride_head
    for part in tl.static_range(3):  # the window's edge (masked), the middle, the diagonal
        if USE_WINDOW or part != 0:
            if part == 0:
                start, end = lo, tl.minimum(full_lo, hi)
            elif part == 1:
                start, end = full_lo, full_hi
            else:
                start, end = tl.maximum(full_lo, full_hi), hi
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, q_pos, slopes, cache_ptr, table, head_offset, dims, dim_mask,
                start, end, seq_len, window, sm_scale, soft_cap, stride_block, stride_kv,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N, part != 1, USE_WINDOW, USE_ALIBI,
                USE_SOFTCAP, FP8, DOT_FP32, FUSED_SOFTMAX,
            )  # fmt: skip
    result = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]  # 0: rows past the end
    out_offsets = tokens[:, None] * stride_out_tok + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=io_mask)


def default_prefill_config(
    device: torch.device, head_size: int, dtype: torch.dtype, params: AttentionParams
) -> KernelConfig:
    """Tiles measured on an H200 (bf16, head 128): 256x64 is fastest for plain causal
    attention; alibi / soft-cap / window variants keep 128x64, whose 8 warps leave ptxas room
    (4 warps with 128 rows crashed ptxas on one such variant)."""
    if device.type != "cuda":
        return KernelConfig(block_m=256, block_n=128, num_warps=4, num_stages=1)
    if head_size > 128 or dtype == torch.float32:
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    plain = params.alibi_slopes is None and params.soft_cap is None
    if plain and params.sliding_window is None and head_size == 128:
        return KernelConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
    return KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    params: AttentionParams,
    config: KernelConfig | None = None,
    variant: PrefillVariant | None = None,
) -> None:
    """Causal attention of each sequence's new tokens (query/out [T, H, D], sequences back to
    back at `query_start_loc` [B + 1]) over its cached context and themselves. `config` and
    `variant` default to `default_prefill_config` and `PrefillVariant()`."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_size = query.shape
    if num_seqs == 0:
        return
    if query.stride()[1:] != (head_size, 1) or out.stride()[1:] != (head_size, 1):
        raise ValueError("query and out must be contiguous within each token's heads")
    cfg = config or default_prefill_config(query.device, head_size, query.dtype, params)
    switches = variant or PrefillVariant()
    plain = params.alibi_slopes is None and params.soft_cap is None
    plain = plain and params.sliding_window is None
    storage = cache_storage(kv_cache)
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, group_pad)
    num_q_tiles = triton.cdiv(max_query_len, block_m // group_pad)
    _paged_prefill_kernel[(num_q_tiles * num_seqs * num_kv_heads,)](
        query, storage, block_table, seq_lens, query_start_loc,
        params.alibi_slopes if params.alibi_slopes is not None else query,
        out, num_q_tiles, num_seqs, query.stride(0), out.stride(0), block_table.stride(0),
        storage.stride(0), storage.stride(1), storage.stride(2),
        params.scale * params.k_scale, params.soft_cap or 1.0, params.v_scale,
        params.sliding_window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        USE_WINDOW=params.sliding_window is not None,
        USE_ALIBI=params.alibi_slopes is not None,
        USE_SOFTCAP=params.soft_cap is not None,
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        DOT_FP32=query.dtype == torch.float32 or query.device.type == "cpu",
        GLOBAL_HEAVY_FIRST=switches.global_heavy_first,
        FUSED_SOFTMAX=switches.fused_softmax and plain,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
