"""CPU_NATIVE: paged attention in one native call per layer (`native/cpu_attention.c`), float32
on the CPU, where its kernel builds (an AVX2 CPU and a C compiler); preferred there over
TORCH_SDPA, whose per-step gathers and masks cost a decode step more than the attention itself.

KV layout: [2, num_blocks, block_size, num_kv_heads, head_size] (K then V, as TORCH_SDPA's). The
builder hands the kernel the layout's own host tensors (slot of each new token, its sequence and
position, the block table); the kernel writes the new K/V and reads the cache in place. For
captured decode steps (CPU graphs, `worker.graphs.cpu`) it writes them into persistent
buffers instead, whose addresses the recorded kernel calls hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.layout import StepLayout
from attnserve.attention.ops.cpu_attention import cpu_attention_library, cpu_paged_attention


@dataclass(frozen=True)
class CpuNativeMetadata(AttentionMetadata):
    token_seq: torch.Tensor  # [T] int64
    token_pos: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, W] int64, contiguous


class CpuNativeMetadataBuilder(AttentionMetadataBuilder[CpuNativeMetadata]):
    _graph: CpuNativeMetadata | None = None  # the persistent buffers, largest bucket's size

    def build(self, layout: StepLayout) -> CpuNativeMetadata:
        return CpuNativeMetadata(
            **layout.common_metadata(self.device),
            token_seq=layout.token_seq.contiguous(),
            token_pos=layout.token_pos.contiguous(),
            block_table=layout.block_table.contiguous(),
        )

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self._graph = CpuNativeMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=max_num_seqs,
            slot_mapping=torch.zeros(max_num_seqs, dtype=torch.int64),
            token_seq=torch.arange(max_num_seqs, dtype=torch.int64),
            token_pos=torch.zeros(max_num_seqs, dtype=torch.int64),
            block_table=torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int64),
        )

    def build_for_graph(self, layout: StepLayout) -> CpuNativeMetadata:
        buffers = self._graph
        if buffers is None:
            raise RuntimeError("call init_graph_buffers before build_for_graph")
        size = layout.num_seqs
        buffers.slot_mapping[:size] = layout.slot_mapping
        buffers.token_pos[:size] = layout.token_pos
        buffers.block_table[:size, : layout.block_table.shape[1]] = layout.block_table
        return CpuNativeMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=size,
            slot_mapping=buffers.slot_mapping[:size],
            token_seq=buffers.token_seq[:size],
            token_pos=buffers.token_pos[:size],
            block_table=buffers.block_table[:size],
        )


class CpuNativeImpl(AttentionImpl[CpuNativeMetadata]):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CpuNativeMetadata,
    ) -> torch.Tensor:
        if kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous():
            raise ValueError("CPU_NATIVE takes a contiguous float32 KV cache")
        tables = (
            attn_metadata.slot_mapping.contiguous(),
            attn_metadata.token_seq,
            attn_metadata.token_pos,
            attn_metadata.block_table,
        )
        slopes = None if self.alibi_slopes is None else self.alibi_slopes.contiguous()
        out = cpu_paged_attention(
            query,
            key,
            value,
            kv_cache,
            tables,
            (self.num_heads, self.num_kv_heads, self.head_size),
            self.scale,
            self.sliding_window,
            self.logits_soft_cap,
            slopes,
        )
        return out if out.dtype == query.dtype else out.to(query.dtype)


class CpuNativeBackend(AttentionBackend):
    name = "CPU_NATIVE"
    impl_cls = CpuNativeImpl
    builder_cls = CpuNativeMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float32,),
        devices=("cpu",),
        head_sizes=None,
        min_block_size=1,
        max_block_size=256,
        sliding_window=True,
        alibi=True,
        logits_soft_cap=True,
        graphs=True,
        priority=5,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if cpu_attention_library() is None:
            return "its native kernel cannot be built here (needs an AVX2 CPU and a C compiler)"
        return None

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        """The capabilities' reasons first: the kernel is built only for a spec it could serve
        (a CUDA run never compiles it)."""
        reasons = cls.capabilities.unsupported_reasons(spec)
        missing = None if reasons else cls.unavailable_reason()
        return reasons + ([missing] if missing else [])

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
