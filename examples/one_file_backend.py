"""A complete attention backend in one file: a block-first KV layout and a simple operator.

Layout [num_blocks, 2, block_size, num_kv_heads, head_size]. The builder (made once per spec,
`OneFileBuilder(spec, device)`) hands the operator each sequence's block ids and lengths from the
step's `StepLayout`; the operator gathers each sequence's keys and values and calls
`scaled_dot_product_attention` per sequence. Slow, but correct: it passes the conformance suite
(`tests/attention`), which is how a backend author knows a new backend is right.
Register it with `attnserve.attention.register_backend("ONE_FILE", OneFileBackend)`.
"""

from __future__ import annotations

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
from attnserve.attention.layout import StepLayout


@dataclass(frozen=True)
class OneFileMetadata(AttentionMetadata):
    block_tables: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]


class OneFileBuilder(AttentionMetadataBuilder[OneFileMetadata]):
    def build(self, layout: StepLayout) -> OneFileMetadata:
        return OneFileMetadata(
            **layout.common_metadata(self.device),
            block_tables=layout.block_table.tolist(),
            context_lens=layout.context_lens.tolist(),
            query_lens=layout.query_lens.tolist(),
        )


class OneFileImpl(AttentionImpl[OneFileMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: OneFileMetadata,
    ) -> torch.Tensor:
        if self.alibi_slopes is not None or self.logits_soft_cap is not None:
            raise ValueError("OneFile supports neither ALiBi nor soft-cap")
        block_size = kv_cache.shape[2]
        kv = kv_cache.view(-1, 2, block_size, self.num_kv_heads, self.head_size)
        for t, slot in enumerate(attn_metadata.slot_mapping.tolist()):
            if slot >= 0:
                kv[slot // block_size, 0, slot % block_size] = key[t].view(self.num_kv_heads, -1)
                kv[slot // block_size, 1, slot % block_size] = value[t].view(self.num_kv_heads, -1)
        out, start = torch.empty_like(query), 0
        for blocks, ctx, q_len in zip(
            attn_metadata.block_tables,
            attn_metadata.context_lens,
            attn_metadata.query_lens,
            strict=True,
        ):
            seq_kv = kv[blocks].transpose(0, 1).flatten(1, 2)[:, : ctx + q_len]  # [2, L, Hkv, D]
            q = query[start : start + q_len].view(q_len, self.num_heads, -1).transpose(0, 1)
            k, v = (x.transpose(0, 1) for x in seq_kv)  # [Hkv, L, D]
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            rows = torch.arange(ctx, ctx + q_len, device=q.device)[:, None]
            cols = torch.arange(ctx + q_len, device=q.device)[None, :]
            mask = cols <= rows
            if self.sliding_window is not None:
                mask &= rows - cols < self.sliding_window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out[start : start + q_len] = o.transpose(0, 1).reshape(q_len, -1)
            start += q_len
        return out


class OneFileBackend(AttentionBackend):
    name = "ONE_FILE"
    impl_cls = OneFileImpl
    builder_cls = OneFileBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        devices=("cpu", "cuda"),
        sliding_window=True,
        priority=-1,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)
