"""Routing for the fused-MoE kernels: the router's softmax → top-k (→ renormalise) of every token
in one Triton launch (`fused_topk`), and the sort of the routed (token, expert) pairs by expert
into runs padded to whole blocks of BLOCK_M rows (`align_block_size`).

At decode sizes a step's MoE layer is a handful of kernels, so each one counts: the sort is one
Triton launch (and a fill) up to `TRITON_ALIGN_MAX_PAIRS` pairs, where torch's sort, cumsums and
scatters would be some twenty launches; larger (prefill) batches, where those cost nothing beside
the GEMMs, are sorted with torch ops, which also serve as the reference of the Triton sort (both
give the same result: within an expert, pairs keep their order).

Both are CUDA-graph safe: no host syncs, buffers sized by shapes only (the padded length is an
upper bound; `num_padded` says how much is in use). Without a GPU they run through Triton's
interpreter (TRITON_INTERPRET=1, set before this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TRITON_ALIGN_MAX_PAIRS = 4096
_ALIGN_CHUNK = 32  # pairs per program of the Triton sort
_BLOCKS_TILE = 64  # blocks whose expert program 0 finds at a time


@dataclass(frozen=True)
class AlignedRoutes:
    """The routed pairs sorted by expert, each expert's run padded to whole blocks."""

    sorted_pairs: torch.Tensor  # [capacity] int32: pair ids (token · top_k + slot); padding = pairs
    block_experts: torch.Tensor  # [capacity / block_m] int32: each block's expert
    num_padded: torch.Tensor  # [1] int32: rows in use (blocks from here on are skipped)


def _capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows enough for any routing: at most min(pairs, experts) experts are in use, each padded
    by fewer than block_m rows."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRoutes:
    """Sort the pairs of `topk_ids` [T, top_k] by expert (within an expert by pair id) into runs
    padded to multiples of `block_m`."""
    if topk_ids.numel() <= TRITON_ALIGN_MAX_PAIRS:
        return align_with_triton(topk_ids, num_experts, block_m)
    return align_with_torch(topk_ids, num_experts, block_m)


def align_with_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRoutes:
    flat = topk_ids.flatten().long()
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    slots = (padded_end - padded)[experts] + rank
    capacity = _capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[slots] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return AlignedRoutes(
        sorted_pairs,
        block_experts.clamp_(max=num_experts - 1).to(torch.int32),
        padded_end[-1:].to(torch.int32),
    )


@triton.jit
def _align_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCKS_TILE: tl.constexpr,
) -> None:
    """Program c places pairs [c·CHUNK, (c+1)·CHUNK): expert e's run starts at the padded counts
    of the experts before e; a pair's slot adds the pairs of e in earlier chunks and earlier in
    its own. Program 0 also writes each block's expert and the padded total. Bins past the experts
    hold the padding of the id vector (id BINS / 2) and count for nothing."""
    chunk = tl.program_id(0)
    bins = tl.arange(0, BINS)
    pairs = tl.arange(0, PAIRS_PAD)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=BINS // 2).to(tl.int32)
    counts = tl.where(bins < NUM_EXPERTS, tl.histogram(ids, BINS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    earlier = tl.histogram(tl.where(pairs < chunk * CHUNK, ids, BINS // 2), BINS)
    run_start = padded_end - padded + tl.where(bins < NUM_EXPERTS, earlier, 0)
    mine = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = mine < num_pairs
    my_ids = tl.load(ids_ptr + mine, mask=valid, other=BINS // 2).to(tl.int32)
    onehot = (my_ids[:, None] == bins[None, :]).to(tl.int32)
    before_in_chunk = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    slot = tl.sum(onehot * run_start[None, :], axis=1) + before_in_chunk
    tl.store(sorted_pairs_ptr + slot, mine.to(tl.int32), mask=valid)
    if chunk == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        for first in range(0, num_blocks, BLOCKS_TILE):
            blocks = first + tl.arange(0, BLOCKS_TILE)
            ended = (padded_end[None, :] <= (blocks * BLOCK_M)[:, None]) & (bins < NUM_EXPERTS)
            expert = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), NUM_EXPERTS - 1)
            tl.store(block_experts_ptr + blocks, expert, mask=blocks < num_blocks)


def align_with_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRoutes:
    """`align_with_torch` in one Triton launch (and a fill), for up to TRITON_ALIGN_MAX_PAIRS."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    if num_pairs > TRITON_ALIGN_MAX_PAIRS:
        raise ValueError(
            f"{num_pairs} pairs: the Triton sort takes {TRITON_ALIGN_MAX_PAIRS} at most"
        )
    capacity = _capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if num_pairs:
        _align_kernel[(triton.cdiv(num_pairs, _ALIGN_CHUNK),)](
            flat,
            sorted_pairs,
            block_experts,
            num_padded,
            num_pairs,
            capacity // block_m,
            NUM_EXPERTS=num_experts,
            BINS=2 * triton.next_power_of_2(num_experts),
            PAIRS_PAD=triton.next_power_of_2(num_pairs),
            BLOCK_M=block_m,
            CHUNK=_ALIGN_CHUNK,
            BLOCKS_TILE=_BLOCKS_TILE,
        )
    return AlignedRoutes(sorted_pairs, block_experts, num_padded)


@triton.jit
def _topk_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
) -> None:
    """One token: softmax of its router logits in float32, then TOP_K times the most probable
    remaining expert (the lowest id among equals), renormalised when asked."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)
    real = experts < NUM_EXPERTS
    x = tl.load(logits_ptr + token * stride_logits + experts, mask=real, other=-float("inf"))
    x = x.to(tl.float32)
    exp = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(real, exp / tl.sum(exp, axis=0), -1.0)
    slots = tl.arange(0, K_PAD)
    top_probs = tl.zeros((K_PAD,), dtype=tl.float32)
    top_ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0, tie_break_left=True)
        top_probs = tl.where(slots == slot, tl.max(probs, axis=0), top_probs)
        top_ids = tl.where(slots == slot, best, top_ids)
        probs = tl.where(experts == best, -1.0, probs)
    if RENORMALIZE:
        top_probs = top_probs / tl.sum(top_probs, axis=0)
    out = token * TOP_K + slots
    used = slots < TOP_K
    tl.store(weights_ptr + out, top_probs.to(weights_ptr.dtype.element_ty), mask=used)
    tl.store(ids_ptr + out, top_ids, mask=used)


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.select_experts` in one launch: (weights [T, top_k] in `weights_dtype`, expert ids
    [T, top_k] int32)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the experts)")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _topk_kernel[(num_tokens,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            NUM_EXPERTS=num_experts,
            EXPERTS_PAD=triton.next_power_of_2(num_experts),
            TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
        )
    return weights, ids
