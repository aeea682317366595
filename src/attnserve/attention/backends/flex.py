"""FLEX_ATTENTION: `torch.nn.attention.flex_attention` over the paged cache, with no gather
(CUDA only).

KV layout: [2, num_blocks, block_size, num_kv_heads, head_size] (K then V). The operator hands
flex_attention the cache as one key/value "batch" of physical slots, and each sequence of the
step as one query batch; a block mask built from the block tables lists, for each sequence and
query tile, exactly its own pages up to the causal limit (in 16-slot tiles), so the kernel
reads only those pages and never copies K/V into logical order. Its mask_mod maps a
physical slot back to the sequence's logical position (causal, sliding window); its score_mod
applies soft-cap, then ALiBi. The builder prepares the per-step tensors and the block mask (for
its spec's sliding window) once for all layers. Prefills and decodes are two calls.
flex_attention is compiled once (`torch.compile`) and reused.

CPU: eager flex_attention gives correct results (the conformance suite passed on CPU), but each
new head count, dtype or feature mix re-traces inside it (about 1.5 s a case), so the suite took
~100 s on the 2-core CI machine; the backend is therefore declared for CUDA only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.backends.utils import query_grid, write_to_slots
from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import FlexKernelOptions

Q_SPARSE_BLOCK = 128  # query rows per block-mask tile
# key slots per block-mask tile, and the kernel's KV tile: pages are multiples of it. One value
# for every block size, so the compiled kernel never sees it change (a changed int would turn
# into a dynamic shape, which flex_attention's lowering rejects on torch 2.11)
KV_SPARSE_BLOCK = 16
# configurations of the compiled flex_attention call per process: each mix of head count, dtype,
# window and soft-cap is one, per prefill and decode call; a process that builds many engines
# (the H200 Gemma parity suite: two models, four setups, two dtypes) met 64
RECOMPILE_LIMIT = 256

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
Positions = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FlexGroup:
    """A padded [B, Q] query grid over some sequences of the step (prefills or decodes), and
    the pages they read: the cache's physical slots 0 .. kv_len - 1, one key/value batch."""

    token_slice: slice  # the group's new tokens in the flat batch
    row_of_token: torch.Tensor  # [Tg] flat index into the [B * Q] query grid
    grid_token: torch.Tensor  # [B, Q] flat-batch token of each query row (padding: any)
    kv_len: int  # slots up to the end of the highest page the group uses
    positions: Positions  # (b, q_idx, kv_idx) -> (query position, logical key position)
    block_mask: BlockMask  # each query tile's own pages up to its causal (and window) limit


@dataclass(frozen=True)
class FlexMetadata(AttentionMetadata):
    prefill: FlexGroup | None
    decode: FlexGroup | None


def _positions(
    table: torch.Tensor,
    live: torch.Tensor,
    num_cache_pages: int,
    query_pos: torch.Tensor,
    block_size: int,
) -> Positions:
    """(b, q_idx, kv_idx) -> (query position, logical key position; -1 off b's live pages);
    `table`'s ids are below `num_cache_pages`."""
    logical = torch.arange(table.shape[1]).expand_as(table)
    pages = torch.where(live, table, num_cache_pages)  # padding and pages behind: spare
    page_to_logical = torch.full((table.shape[0], num_cache_pages + 1), -1, dtype=torch.int64)
    page_to_logical.scatter_(1, pages, logical.contiguous())
    page_to_logical = to_device(page_to_logical[:, :num_cache_pages], query_pos.device)

    def positions(
        b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        page = page_to_logical[b, kv_idx // block_size]
        key_pos = torch.where(page >= 0, page * block_size + kv_idx % block_size, -1)
        return query_pos[b, q_idx], key_pos

    return positions


def _flex_group(
    layout: StepLayout, seqs: range, spec: AttentionSpec, device: torch.device
) -> FlexGroup | None:
    if len(seqs) == 0:
        return None
    grid, block_size = query_grid(layout, seqs, padding_pos=-1), spec.block_size
    num_rows = grid.num_rows
    seq_lens = layout.seq_lens[seqs.start : seqs.stop]
    context_lens = layout.context_lens[seqs.start : seqs.stop]
    num_pages = -(-seq_lens // block_size)
    table = layout.block_table[seqs.start : seqs.stop, : int(num_pages.max())]
    # pages before the window of the first new token are never read (a window's KV-cache
    # group may have freed them: their ids may be any block's now)
    first_page = torch.zeros_like(num_pages)
    if spec.sliding_window is not None:
        first_page = (context_lens - spec.sliding_window + 1).clamp(min=0) // block_size
    logical = torch.arange(table.shape[1])
    live = (logical >= first_page[:, None]) & (logical < num_pages[:, None])
    table = torch.where(live, table, 0)
    # a query tile reads its sequence's pages from the first live one up to its last row's
    # position (causal)
    tiles = -(-num_rows // Q_SPARSE_BLOCK)
    tile_last_row = torch.arange(1, tiles + 1) * Q_SPARSE_BLOCK - 1
    last_pos = torch.minimum(context_lens[:, None] + tile_last_row[None, :], seq_lens[:, None] - 1)
    kv_num_blocks = (
        torch.minimum(last_pos // block_size + 1, num_pages[:, None]) - first_page[:, None]
    )
    read = table.gather(1, (first_page[:, None] + logical).clamp(max=table.shape[1] - 1))
    # page p is KV tiles p * per_page .. p * per_page + per_page - 1
    per_page = block_size // KV_SPARSE_BLOCK
    tile_ids = (read[:, :, None] * per_page + torch.arange(per_page)).flatten(1)
    query_pos = to_device(grid.query_pos.view(len(seqs), num_rows), device)
    kv_indices = tile_ids[:, None, None, :].expand(-1, 1, tiles, -1)
    num_cache_pages = int(table.max()) + 1
    positions = _positions(table, live, num_cache_pages, query_pos, block_size)
    kv_len = num_cache_pages * block_size
    block_mask = BlockMask.from_kv_blocks(
        to_device((kv_num_blocks * per_page)[:, None].to(torch.int32), device),
        to_device(kv_indices.to(torch.int32), device),
        BLOCK_SIZE=(Q_SPARSE_BLOCK, KV_SPARSE_BLOCK),
        mask_mod=_mask_mod(positions, spec.sliding_window),
        seq_lengths=(num_rows, kv_len),
        compute_q_blocks=False,
    )
    return FlexGroup(
        token_slice=grid.tokens,
        row_of_token=to_device(grid.row_of_token, device),
        grid_token=to_device(grid.grid_token.view(len(seqs), num_rows), device),
        kv_len=kv_len,
        positions=positions,
        block_mask=block_mask,
    )


class FlexMetadataBuilder(AttentionMetadataBuilder[FlexMetadata]):
    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        super().__init__(spec, device)
        if spec.block_size % KV_SPARSE_BLOCK != 0:
            raise ValueError(
                f"FLEX_ATTENTION needs a block size multiple of 16, got {spec.block_size}"
            )

    def build(self, layout: StepLayout) -> FlexMetadata:
        prefills = range(0, layout.num_prefills)
        decodes = range(layout.num_prefills, layout.num_seqs)
        return FlexMetadata(
            **layout.common_metadata(self.device),
            prefill=_flex_group(layout, prefills, self.spec, self.device),
            decode=_flex_group(layout, decodes, self.spec, self.device),
        )


def _mask_mod(positions: Positions, window: int | None) -> MaskMod:
    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        q_pos, k_pos = positions(b, q_idx, kv_idx)
        allowed = (k_pos >= 0) & (k_pos <= q_pos)
        return allowed if window is None else allowed & (q_pos - k_pos < window)

    return mask_mod


def _score_mod(positions: Positions, cap: float | None, slopes: torch.Tensor | None) -> ScoreMod:
    """Soft-cap the scaled score, then add the ALiBi bias slope_h * (key_pos - query_pos)."""

    def score_mod(
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
    ) -> torch.Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            q_pos, k_pos = positions(b, q_idx, kv_idx)
            score = score + slopes[h] * (k_pos - q_pos)
        return score

    return score_mod


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once and reused by every layer and step (new shapes extend it,
    dynamically after the first), with a KV tile as wide as the block mask's (a constant), on
    the standard kernel: torch's flex-decoding kernel, which it would pick for short query
    grids, finds no valid tile for fp32 at head size 128 or for groups of 8 on the H200."""
    kernel_options: FlexKernelOptions = {"BLOCK_N": KV_SPARSE_BLOCK, "BACKEND": "TRITON"}

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        score_mod: ScoreMod | None,
        block_mask: BlockMask,
        scale: float,
        enable_gqa: bool,
    ) -> torch.Tensor:
        return flex_attention(
            q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options=kernel_options
        )

    # each new head count, dtype or feature mix is a recompile of the one call; a process
    # serving several models (or the conformance suite) may need more than dynamo's 8. Raised
    # once here: patching the config around every call would cost ~0.3 ms a call on the host.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    compiled: Callable[..., torch.Tensor] = torch.compile(run, fullgraph=True)
    return compiled


class FlexImpl(AttentionImpl[FlexMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlexMetadata,
    ) -> torch.Tensor:
        k_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)  # [slots, Hkv, D]
        v_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        write_to_slots(key, value, k_cache, v_cache, attn_metadata.slot_mapping)
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.empty_like(q)
        for group in (attn_metadata.prefill, attn_metadata.decode):
            if group is not None:
                out[group.token_slice] = self._attend(q, k_cache, v_cache, group)
        return out.view(-1, self.num_heads * self.head_size)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: FlexGroup,
    ) -> torch.Tensor:
        if self.alibi_slopes is not None and self.alibi_slopes.device != q.device:
            self.alibi_slopes = self.alibi_slopes.to(q.device)  # once, not per call
        slopes = self.alibi_slopes
        use_score_mod = self.logits_soft_cap is not None or slopes is not None
        out = _compiled_flex()(
            q[group.grid_token].transpose(1, 2),  # [B, H, Q, D]
            k_cache[: group.kv_len].transpose(0, 1)[None],  # [1, Hkv, slots, D], physical order
            v_cache[: group.kv_len].transpose(0, 1)[None],
            _score_mod(group.positions, self.logits_soft_cap, slopes) if use_score_mod else None,
            group.block_mask,
            self.scale,
            self.num_heads != self.num_kv_heads,
        )
        rows = out.transpose(1, 2).reshape(-1, self.num_heads, self.head_size)
        return rows[group.row_of_token]


class FlexAttentionBackend(AttentionBackend):
    name = "FLEX_ATTENTION"
    impl_cls = FlexImpl
    builder_cls = FlexMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        devices=("cuda",),
        # Head size 80 does not compile on the H200 once the call has turned dynamic (inductor
        # NoValidChoicesError, fp16, torch 2.11): powers of two only, which compile.
        head_sizes=(64, 128, 256),
        # Larger pages do not compile on the H200 (inductor NoValidChoicesError, block size
        # 32 with window + ALiBi + soft-cap, torch 2.11): only 16 is declared.
        min_block_size=16,
        max_block_size=16,
        sliding_window=True,
        alibi=True,
        logits_soft_cap=True,
        priority=1,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
