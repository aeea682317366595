"""Triton paged prefill attention: prompts and chunked prefills over their cached context.

One program computes BLOCK_M query rows of one sequence: BLOCK_M / GROUP_PAD consecutive tokens
times every query head of one KV head (a GQA group), so each K/V tile is loaded once per group;
an online softmax runs over BLOCK_N-key tiles (tensor-core dots). Key tiles that no mask touches
(before the tile's first token, inside every row's window) run without mask code; the rest (the
causal diagonal, the window's edge, a context's last partial tile) are masked. A 1-D grid runs
each (sequence, KV head)'s query tiles longest first, so neighbouring programs share K/V in L2.

Where the new tokens' keys come from (`PrefillVariant.fresh_keys`):
- "cache": every key, the new tokens' too, is gathered from the paged cache through the block
  table (they were written there first by `triton_cache`). Page ids are loaded once per key
  row, never per element. The only source for ALiBi, soft-cap, sliding windows and head sizes
  that are not a power of two.
- "pointers" / "tma": the cached context is gathered from the pages, and the new tokens' keys
  are read from the step's own K/V tensors, rows of one sequence back to back: plain loads, or
  Hopper's bulk tensor copies (a host `TensorDescriptor`, Triton 3.4+, compute capability 9+),
  which land K/V tiles in shared memory without the registers and address math of a gather.

With an fp8 cache the context's keys are scaled in the softmax (its k_scale folded into the
score's scale) and its values' tiles multiplied by v_scale; the new tokens' own K/V, read from
the step, are unquantized. Reading every key from the cache folds v_scale into the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from attnserve.attention.ops.triton_cache import cache_storage
from attnserve.attention.ops.triton_common import (
    AttentionParams,
    KernelConfig,
    attend_plain_tile,
    attend_tile,
    is_fp8,
    load_kv,
    load_scales,
    scales_operand,
)

FreshKeys = Literal["cache", "pointers", "tma"]
_FRESH_CODE = {"cache": 0, "pointers": 1, "tma": 2}


@dataclass(frozen=True)
class PrefillVariant:
    """Structural switches of the prefill kernel (see the module docstring); None: the
    fastest source the call allows (`fresh_keys_for`)."""

    fresh_keys: FreshKeys | None = None


@triton.jit
def _attend_cached(  # type: ignore[no-untyped-def]
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
    kv_end,
    window,
    sm_scale,
    soft_cap,
    v_scale,
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
    PLAIN: tl.constexpr,
    SCALE_V: tl.constexpr,
):
    """Fold the paged cache's key tiles [start, end) (keys at or past kv_end masked) into the
    running softmax state of one query tile; SCALE_V (plain attention only) multiplies each
    value tile by v_scale."""
    for tile in range(start, end, BLOCK_N):
        k_pos = tile + tl.arange(0, BLOCK_N)
        valid = k_pos < kv_end
        if PLAIN:
            k, v = load_kv(
                cache_ptr, table, k_pos, valid, head_offset, dims, dim_mask, stride_block,
                stride_kv, HEAD_SIZE, HEAD_PAD == HEAD_SIZE, BLOCK_SIZE, MASKED, FP8, q.dtype,
            )  # fmt: skip
            if SCALE_V:
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            allowed = (k_pos[None, :] <= q_pos[:, None]) & valid[None, :]
            acc, m_i, l_i = attend_plain_tile(
                acc, m_i, l_i, q, k, v, allowed, sm_scale * 1.4426950408889634, MASKED, DOT_FP32
            )
        else:
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, slopes, k_pos, valid, cache_ptr, table, head_offset,
                dims, dim_mask, window, sm_scale, soft_cap, stride_block, stride_kv, HEAD_SIZE,
                HEAD_PAD == HEAD_SIZE, BLOCK_SIZE, 2 if MASKED else 0, USE_WINDOW, USE_ALIBI,
                USE_SOFTCAP, FP8, DOT_FP32,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_fresh(  # type: ignore[no-untyped-def]
    acc,
    m_i,
    l_i,
    q,
    token,
    k_src,
    v_src,
    first_row,
    head_col,
    dims,
    start,
    end,
    query_len,
    qk_scale,
    stride_fresh,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    TMA: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold the new tokens' own key tiles [start, end) (indices among the new tokens; rows
    first_row + index of the step's K/V) into the running softmax state of one query tile
    (token: each row's index among the new tokens). Masked tiles apply the causal mask; with
    TMA a tile past the sequence reads the next one's rows (or zeros), which that mask hides."""
    for tile in range(start, end, BLOCK_N):
        index = tile + tl.arange(0, BLOCK_N)
        if TMA:
            k = k_src.load([first_row + tile, head_col])
            v = v_src.load([first_row + tile, head_col])
        else:
            offsets = (first_row + index).to(tl.int64)[:, None] * stride_fresh + head_col
            offsets += dims[None, :]
            if MASKED:
                k = tl.load(k_src + offsets, mask=(index < query_len)[:, None], other=0.0)
                v = tl.load(v_src + offsets, mask=(index < query_len)[:, None], other=0.0)
            else:
                k = tl.load(k_src + offsets)
                v = tl.load(v_src + offsets)
        allowed = index[None, :] <= token[:, None]
        acc, m_i, l_i = attend_plain_tile(
            acc, m_i, l_i, q, k, v, allowed, qk_scale, MASKED, DOT_FP32
        )
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_q_tiles", "stride_table", "window"])
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_src,
    v_src,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    slopes_ptr,
    out_ptr,
    num_q_tiles,
    stride_q_tok,
    stride_fresh,
    stride_out_tok,
    stride_table,
    stride_block,
    stride_kv,
    stride_head,
    scales_ptr,
    sm_scale,
    soft_cap,
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
    PLAIN: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
    FRESH: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    q_tile = num_q_tiles - 1 - pid % num_q_tiles  # the most keys first
    seq = pid // num_q_tiles // NUM_KV_HEADS
    kv_head = pid // num_q_tiles % NUM_KV_HEADS
    TOKENS: tl.constexpr = BLOCK_M // GROUP_PAD
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if q_tile * TOKENS >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    first_pos = context_len + q_tile * TOKENS  # the tile's first token
    last_pos = first_pos + TOKENS - 1

    rows = tl.arange(0, BLOCK_M)  # row r: token r // GROUP_PAD, query head r % GROUP_PAD
    token = q_tile * TOKENS + rows // GROUP_PAD
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head * stride_head
    k_scale, v_scale = load_scales(scales_ptr, kv_head, NUM_KV_HEADS, FP8)
    # the cache's keys: all of them, or only the context when the new ones come from the step
    cached_end = context_len if FRESH != 0 else tl.minimum(seq_len, last_pos + 1)
    full_hi = tl.minimum(first_pos + 1, cached_end) // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    if HAS_CONTEXT:  # else every key is a new token's, read from the step
        for part in tl.static_range(3):  # the window's edge (masked), middle, rest (masked)
            if USE_WINDOW or part != 0:
                if part == 0:
                    start, end = lo, tl.minimum(full_lo, cached_end)
                elif part == 1:
                    start, end = full_lo, full_hi
                else:
                    start, end = tl.maximum(full_lo, full_hi), cached_end
                acc, m_i, l_i = _attend_cached(
                    acc, m_i, l_i, q, q_pos, slopes, cache_ptr, table, head_offset, dims,
                    dim_mask, start, end, cached_end, window, sm_scale * k_scale, soft_cap,
                    v_scale, stride_block, stride_kv, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N,
                    part != 1, USE_WINDOW, USE_ALIBI, USE_SOFTCAP, FP8, DOT_FP32, PLAIN,
                    FP8 and FRESH != 0,
                )  # fmt: skip
    if FRESH != 0:
        diagonal = q_tile * TOKENS // BLOCK_N * BLOCK_N
        fresh_end = tl.minimum(q_tile * TOKENS + TOKENS, query_len)
        head_col = kv_head * HEAD_SIZE
        qk_scale = sm_scale * 1.4426950408889634
        acc, m_i, l_i = _attend_fresh(  # the new tokens before the tile: unmasked
            acc, m_i, l_i, q, token, k_src, v_src, query_start, head_col, dims, 0, diagonal,
            query_len, qk_scale, stride_fresh, BLOCK_N, False, FRESH == 2, DOT_FP32,
        )  # fmt: skip
        acc, m_i, l_i = _attend_fresh(  # the diagonal: causal mask
            acc, m_i, l_i, q, token, k_src, v_src, query_start, head_col, dims, diagonal,
            fresh_end, query_len, qk_scale, stride_fresh, BLOCK_N, True, FRESH == 2, DOT_FP32,
        )  # fmt: skip
    out_scale = v_scale if FRESH == 0 else 1.0  # every value from the cache: v_scale folds in
    result = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]  # 0: rows past the end
    out_offsets = tokens[:, None] * stride_out_tok + heads[:, None] * HEAD_SIZE + dims[None, :]
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=io_mask)


def default_prefill_config(
    device: torch.device, head_size: int, dtype: torch.dtype, fresh: FreshKeys, max_query_len: int
) -> KernelConfig:
    """Tiles measured on an H200 (bf16, head 128, docs/benchmarks.md). New keys read by TMA:
    128x128 on 8 warps for prompts of 2048+ tokens, else 64x64 (16 tokens x 4 heads) on 4; by
    plain loads (GPUs without TMA): 256x64 on 8 warps; every key gathered from the cache:
    128x64, whose 8 warps leave ptxas room for ALiBi / soft-cap / window."""
    if device.type != "cuda":
        return KernelConfig(block_m=256, block_n=128, num_warps=4, num_stages=1)
    if head_size > 128 or dtype == torch.float32:
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if fresh == "tma" and max_query_len >= 2048:
        return KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    if fresh == "tma":
        return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    if fresh == "pointers" and head_size == 128:
        return KernelConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
    return KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def _is_plain(params: AttentionParams) -> bool:
    """Plain causal attention: no ALiBi, soft-cap or sliding window."""
    no_window = params.sliding_window is None
    return params.alibi_slopes is None and params.soft_cap is None and no_window


def fresh_keys_for(
    query: torch.Tensor, key: torch.Tensor | None, kv_cache: torch.Tensor, params: AttentionParams
) -> FreshKeys:
    """Where a call reads the new tokens' keys by default (module docstring): from the step's
    K/V when the call is plain causal attention over a cache of the query's dtype or fp8, by
    TMA where the GPU has it and the rows are 16-byte aligned."""
    head_size = query.shape[-1]
    if key is None or not _is_plain(params):
        return "cache"
    if kv_cache.dtype not in (query.dtype, torch.float8_e4m3fn) or head_size & (head_size - 1):
        return "cache"
    aligned = key.data_ptr() % 16 == 0 and key.stride(0) * key.element_size() % 16 == 0
    if aligned and query.is_cuda and torch.cuda.get_device_capability(query.device)[0] >= 9:
        return "tma"
    return "pointers"


def _resolve_fresh_keys(
    query: torch.Tensor,
    key: torch.Tensor | None,
    kv_cache: torch.Tensor,
    params: AttentionParams,
    wanted: FreshKeys | None,
) -> FreshKeys:
    """`wanted`, or the default, where the call allows reading keys from the step."""
    allowed = fresh_keys_for(query, key, kv_cache, params)
    if allowed == "cache" and wanted not in (None, "cache"):
        raise ValueError(
            f"fresh_keys={wanted!r} needs the step's key/value and a plain call (no ALiBi, "
            "soft-cap or window, a power-of-two head size, a cache of the query's dtype or fp8)"
        )
    return allowed if allowed == "cache" else wanted or allowed


def _fresh_sources(
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    fresh: FreshKeys,
    block_n: int,
    placeholder: torch.Tensor,
) -> tuple[object, object]:
    """The kernel's K/V arguments: the tensors, descriptors of their [T, KV heads * D] rows,
    or (keys from the cache) a placeholder the kernel never reads."""
    if key is None or value is None or fresh == "cache":
        return placeholder, placeholder
    if fresh == "pointers":
        return key, value
    tokens, num_kv_heads, head_size = key.shape

    def describe(tensor: torch.Tensor) -> TensorDescriptor:
        shape = [tokens, num_kv_heads * head_size]
        return TensorDescriptor(tensor, shape, [tensor.stride(0), 1], [block_n, head_size])

    return describe(key), describe(value)


def paged_prefill(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    params: AttentionParams,
    config: KernelConfig | None = None,
    variant: PrefillVariant | None = None,
    max_context_len: int | None = None,
) -> None:
    """Causal attention of each sequence's new tokens (query/out [T, H, D]; key/value
    [T, KV heads, D], the same tokens' K/V, also already in the cache, or None to read every
    key from the cache; sequences back to back at `query_start_loc` [B + 1]) over its cached
    context and themselves. `config` and `variant` default to `default_prefill_config` and
    `PrefillVariant()`; `max_context_len` 0 (no sequence has cached context) compiles the
    cache's gather out when the new keys come from key/value (None: unknown)."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_size = query.shape
    if num_seqs == 0:
        return
    if value is None:
        key = None
    for name, tensor in (("query", query), ("out", out), ("key", key), ("value", value)):
        if tensor is not None and tensor.stride()[1:] != (head_size, 1):
            raise ValueError(f"{name} must be contiguous within each token's heads")
    wanted = (variant or PrefillVariant()).fresh_keys
    fresh = _resolve_fresh_keys(query, key, kv_cache, params, wanted)
    cfg = config or default_prefill_config(
        query.device, head_size, query.dtype, fresh, max_query_len
    )
    k_src, v_src = _fresh_sources(key, value, fresh, cfg.block_n, query)
    storage = cache_storage(kv_cache)
    num_kv_heads = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, group_pad)
    num_q_tiles = triton.cdiv(max_query_len, block_m // group_pad)
    _paged_prefill_kernel[(num_q_tiles * num_seqs * num_kv_heads,)](
        query, k_src, v_src, storage, block_table, seq_lens, query_start_loc,
        params.alibi_slopes if params.alibi_slopes is not None else query,
        out, num_q_tiles, query.stride(0), key.stride(0) if key is not None else 0,
        out.stride(0), block_table.stride(0),
        storage.stride(0), storage.stride(1), storage.stride(2),
        scales_operand(params.kv_scales, kv_cache, query),
        params.scale, params.soft_cap or 1.0, params.sliding_window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        USE_WINDOW=params.sliding_window is not None,
        USE_ALIBI=params.alibi_slopes is not None,
        USE_SOFTCAP=params.soft_cap is not None,
        FP8=is_fp8(kv_cache),
        DOT_FP32=query.dtype == torch.float32 or query.device.type == "cpu",
        PLAIN=_is_plain(params),
        HAS_CONTEXT=fresh == "cache" or max_context_len != 0,
        FRESH=_FRESH_CODE[fresh],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
