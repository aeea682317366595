"""Triton paged decode attention (flash-decoding).

One program handles every query head of one KV head (a GQA group) of one sequence over one
split of its keys, so each KV page is read once per group; the group's query heads are the rows
of a tensor-core dot (padded to 16). When the batch alone cannot fill the GPU the keys are split
into `num_splits` parts (chosen from batch size, context length and SM count); each split writes
a partial output and its log-sum-exp, and a small kernel merges them. The tile step and the
K/V loads are `triton_common`'s.

An fp8 cache's bytes are converted to fp16 on the GPU (`cvt.rn.f16x2.e4m3x2`, one instruction
per pair of bytes; value tiles before their layout change, see `triton_common.load_kv`), and the
query with them (fp16's range covers any e4m3 value; a query beyond
+-65504 would overflow); its per-head scales are folded in, the keys' into the softmax scale
and the values' into the output, so no element is multiplied.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnserve.attention.ops.triton_cache import cache_storage
from attnserve.attention.ops.triton_common import (
    AttentionParams,
    KernelConfig,
    attend_tile,
    fp8_mode,
    is_fp8,
    load_scales,
    scales_operand,
)


# Step-dependent arguments are not specialised on, so each kernel compiles once per model
# configuration: the integers, and the table and length pointers, which a mixed step passes as
# slices starting at its first decode (16-byte aligned or not, depending on the prefill count).
@triton.jit(do_not_specialize=["table_ptr", "seq_lens_ptr", "stride_table", "window", "num_splits"])
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    slopes_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_q_tok,
    stride_out_tok,
    stride_table,
    stride_block,
    stride_kv,
    stride_head,
    scales_ptr,
    sm_scale,
    soft_cap,
    window,
    num_splits,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(seq_len - window, 0) if USE_WINDOW else 0
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_SIZE
    row_mask = (rows < GROUP)[:, None] & dim_mask[None, :]
    q_offsets = seq.to(tl.int64) * stride_q_tok + heads[:, None] * HEAD_SIZE + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0)
    if FP8 and not DOT_FP32:
        q = q.to(tl.float16)  # the cache's bytes convert to fp16 (attend_tile: to q's dtype)
    k_scale, v_scale = load_scales(scales_ptr, kv_head, NUM_KV_HEADS, FP8)
    slopes = tl.load(slopes_ptr + heads, mask=rows < GROUP, other=0.0) if USE_ALIBI else None
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    for tile in range(start, end, BLOCK_N):
        k_pos = tile + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, slopes, k_pos, k_pos < end, cache_ptr, table,
            kv_head * stride_head, dims, dim_mask, window, sm_scale * k_scale, soft_cap,
            stride_block, stride_kv, HEAD_SIZE, HEAD_PAD == HEAD_SIZE, BLOCK_SIZE, 1, USE_WINDOW,
            USE_ALIBI, USE_SOFTCAP, FP8, DOT_FP32,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc * (v_scale / l_safe)[:, None]
    if not SPLIT_KEYS:
        out_offsets = seq.to(tl.int64) * stride_out_tok + heads[:, None] * HEAD_SIZE + dims[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], result, mask=row_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=rows < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_tok,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
) -> None:
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    part = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    mask = (splits < num_splits)[:, None] & (dims < HEAD_SIZE)[None, :]
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_SIZE + dims[None, :], mask=mask, other=0.0)
    result = tl.sum(parts * weights[:, None], 0)
    out_offsets = seq.to(tl.int64) * stride_out_tok + head * HEAD_SIZE + dims
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 stands in for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    sm_count: int,
    fp8: bool = False,
    min_split_len: int = 256,
) -> int:
    """How many parts to split each decode sequence's keys into: enough programs for two per
    SM (three for an fp8 cache, whose 2-warp programs fit four to an SM), never parts shorter
    than `min_split_len` tokens, at most 64."""
    programs = num_seqs * num_kv_heads
    if programs == 0:
        return 1
    wanted = -(-(3 if fp8 else 2) * sm_count // programs)
    return max(1, min(wanted, max_seq_len // min_split_len, 64))


def default_decode_config(
    device: torch.device, head_size: int, fp8: bool = False, group_pad: int = 16
) -> KernelConfig:
    """Key tiles of 64 tokens (32 for heads over 128), 4 warps over 3 stages for a bf16 cache.

    An fp8 cache's tiles are converted to fp16 in registers before their dots (ptxas for sm_90,
    head 128: 104 registers a thread at 4 warps, where bf16 takes 86): its programs run 2 warps
    (176 registers) over 5 stages, which keeps more tiles in flight; on the H200 that beat every
    4- and 8-warp tile on the three shapes of `bench kernels` (docs/benchmarks.md). GQA groups
    over 16 heads keep 4 warps."""
    if device.type != "cuda":
        return KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=1)
    block_n = 32 if head_size > 128 else 64
    if fp8 and group_pad <= 16:
        return KernelConfig(block_m=16, block_n=block_n, num_warps=2, num_stages=5)
    return KernelConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=3)


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    params: AttentionParams,
    num_splits: int,
    config: KernelConfig | None = None,
) -> None:
    """Decode attention: query/out [B, H, D] (one token per sequence, the last of each),
    block_table [B, max_blocks] int32, seq_lens [B] int32 (tokens, the new one included)."""
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[2]
    if num_seqs == 0:
        return
    if query.stride()[1:] != (head_size, 1) or out.stride()[1:] != (head_size, 1):
        raise ValueError("query and out must be contiguous within each token's heads")
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    fp8 = is_fp8(kv_cache)
    cfg = config or default_decode_config(query.device, head_size, fp8, group_pad)
    storage = cache_storage(kv_cache)
    part_out = part_lse = out
    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, storage, block_table, seq_lens,
        params.alibi_slopes if params.alibi_slopes is not None else query,
        out, part_out, part_lse,
        query.stride(0), out.stride(0), block_table.stride(0),
        storage.stride(0), storage.stride(1), storage.stride(2),
        scales_operand(params.kv_scales, kv_cache, query),
        params.scale, params.soft_cap or 1.0, params.sliding_window or 0, num_splits,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=kv_cache.shape[3], BLOCK_N=cfg.block_n, SPLIT_KEYS=num_splits > 1,
        USE_WINDOW=params.sliding_window is not None,
        USE_ALIBI=params.alibi_slopes is not None,
        USE_SOFTCAP=params.soft_cap is not None,
        FP8=fp8_mode(kv_cache, query),
        DOT_FP32=query.dtype == torch.float32 or query.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), num_splits,
            NUM_HEADS=num_heads, HEAD_SIZE=head_size,
            HEAD_PAD=triton.next_power_of_2(head_size),
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )  # fmt: skip
