"""TORCH_SDPA: the pure-torch reference backend (CPU and GPU).

KV layout: [2, num_blocks, block_size, num_kv_heads, head_size] (K then V). Each step the
builder prepares, for the prefill and the decode sequences separately, a padded grid that maps
every (sequence, key position) to its cache slot and every (sequence, query row) to its token;
the operator gathers K/V through it and makes one `scaled_dot_product_attention` call per group,
so the work is batched per step with no Python loop over tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    BackendCapabilities,
)
from attnserve.attention.backends.utils import query_grid, write_to_slots
from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device


@dataclass(frozen=True)
class DenseGroup:
    """A padded [B, Q] x [B, L] view of some sequences of the step (prefills or decodes)."""

    token_slice: slice  # the group's new tokens in the flat batch
    row_of_token: torch.Tensor  # [Tg] flat index into the [B * Q] query grid
    grid_token: torch.Tensor  # [B, Q] flat-batch token of each query row (padding: any)
    query_pos: torch.Tensor  # [B, Q] position of each query row (padding: 0)
    key_slots: torch.Tensor  # [B, L] cache slot of each key position (padding: any valid)
    key_valid: torch.Tensor  # [B, L] key position < sequence length


@dataclass(frozen=True)
class TorchSDPAMetadata(AttentionMetadata):
    prefill: DenseGroup | None
    decode: DenseGroup | None


def _dense_group(
    layout: StepLayout, seqs: range, block_size: int, device: torch.device
) -> DenseGroup | None:
    if len(seqs) == 0:
        return None
    grid = query_grid(layout, seqs, padding_pos=0)
    seq_lens = layout.seq_lens[seqs.start : seqs.stop]
    key_pos = torch.arange(int(seq_lens.max()))
    table = layout.block_table[seqs.start : seqs.stop]
    block_col = (key_pos // block_size).clamp(max=table.shape[1] - 1)
    key_slots = table[:, block_col] * block_size + key_pos % block_size
    return DenseGroup(
        token_slice=grid.tokens,
        row_of_token=to_device(grid.row_of_token, device),
        grid_token=to_device(grid.grid_token.view(len(seqs), grid.num_rows), device),
        query_pos=to_device(grid.query_pos.view(len(seqs), grid.num_rows), device),
        key_slots=to_device(key_slots, device),
        key_valid=to_device(key_pos[None, :] < seq_lens[:, None], device),
    )


class TorchSDPAMetadataBuilder(AttentionMetadataBuilder[TorchSDPAMetadata]):
    def build(self, layout: StepLayout) -> TorchSDPAMetadata:
        prefills = range(0, layout.num_prefills)
        decodes = range(layout.num_prefills, layout.num_seqs)
        return TorchSDPAMetadata(
            **layout.common_metadata(self.device),
            prefill=_dense_group(layout, prefills, self.block_size, self.device),
            decode=_dense_group(layout, decodes, self.block_size, self.device),
        )


class TorchSDPAImpl(AttentionImpl[TorchSDPAMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        num_slots = kv_cache.shape[1] * kv_cache.shape[2]
        k_cache = kv_cache[0].view(num_slots, self.num_kv_heads, self.head_size)
        v_cache = kv_cache[1].view(num_slots, self.num_kv_heads, self.head_size)
        write_to_slots(key, value, k_cache, v_cache, attn_metadata.slot_mapping)
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.empty_like(q)
        for group in (attn_metadata.prefill, attn_metadata.decode):
            if group is not None:
                out[group.token_slice] = self._attend_group(q, k_cache, v_cache, group)
        return out.view(-1, self.num_heads * self.head_size)

    def _attend_group(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DenseGroup
    ) -> torch.Tensor:
        """Attention of one dense group. The query heads sharing a KV head are folded into
        that head's query rows ([B, Hkv, G*Q, D]), so K/V are gathered once, never repeated."""
        batch, rows = group.grid_token.shape
        kv_heads, dim = self.num_kv_heads, self.head_size
        group_size = self.num_heads // kv_heads
        q_grid = q[group.grid_token].view(batch, rows, kv_heads, group_size, dim)
        q_grid = q_grid.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group_size * rows, dim)
        k_grid = k_cache[group.key_slots].transpose(1, 2)  # [B, Hkv, L, D]
        v_grid = v_cache[group.key_slots].transpose(1, 2)
        length = k_grid.shape[2]
        allowed = self._allowed(group)[:, :, None].expand(batch, 1, group_size, rows, length)
        allowed = allowed.reshape(batch, 1, group_size * rows, length)
        bias = self._alibi_bias(group)  # [B, H, Q, L] or None
        if bias is not None:
            bias = bias.view(batch, kv_heads, group_size * rows, length)
        if self.logits_soft_cap is not None:
            out = self._soft_capped_attention(
                q_grid, k_grid, v_grid, allowed, bias, self.logits_soft_cap
            )
        else:
            mask = allowed if bias is None else bias.masked_fill(~allowed, -math.inf).to(q.dtype)
            out = F.scaled_dot_product_attention(
                q_grid, k_grid, v_grid, attn_mask=mask, scale=self.scale
            )
        out = out.view(batch, kv_heads, group_size, rows, dim).permute(0, 3, 1, 2, 4)
        return out.reshape(batch * rows, self.num_heads, dim)[group.row_of_token]

    def _allowed(self, group: DenseGroup) -> torch.Tensor:
        key_pos = torch.arange(group.key_slots.shape[1], device=group.key_slots.device)
        distance = group.query_pos[:, :, None] - key_pos[None, None, :]
        allowed = (distance >= 0) & group.key_valid[:, None, :]
        if self.sliding_window is not None:
            allowed &= distance < self.sliding_window
        return allowed[:, None]

    def _alibi_bias(self, group: DenseGroup) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        key_pos = torch.arange(group.key_slots.shape[1], device=group.key_slots.device)
        distance = (key_pos[None, None, :] - group.query_pos[:, :, None]).float()
        slopes = to_device(self.alibi_slopes, distance.device)
        return slopes[None, :, None, None] * distance[:, None]

    def _soft_capped_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        allowed: torch.Tensor,
        bias: torch.Tensor | None,
        cap: float,
    ) -> torch.Tensor:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        scores = cap * torch.tanh(scores / cap)
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        return torch.matmul(probs, v.float()).to(q.dtype)


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"
    impl_cls = TorchSDPAImpl
    builder_cls = TorchSDPAMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        devices=("cpu", "cuda"),
        head_sizes=None,
        min_block_size=1,
        max_block_size=256,
        sliding_window=True,
        alibi=True,
        logits_soft_cap=True,
        priority=0,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
