"""TRITON: attnserve's own Triton kernels, the default backend on NVIDIA GPUs.

KV layout: [num_blocks, 2, num_kv_heads, block_size, head_size]: each block holds its K plane
then its V plane, and within a plane each KV head's page is one contiguous run, so the decode
kernel reads a page with wide coalesced loads. The builder turns a step into the few device
tensors the kernels index (block table, sequence lengths, query start offsets, int32; one copy
each) plus host integers (longest prefill, the decode split count). The operator writes the new
K/V (`triton_cache`), runs the prefill kernel over the prefill sequences and the split-KV decode
kernel over the decodes. With TRITON_INTERPRET=1 the same kernels run on the CPU (for tests;
the interpreter is never preferred over a native backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.backends.utils import (
    DecodeGraphBuffers,
    int32_block_table,
    int32_on,
)
from attnserve.attention.kv_scales import KVCacheScales
from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device

try:
    from attnserve.attention.ops.triton_cache import reshape_and_cache
    from attnserve.attention.ops.triton_common import AttentionParams
    from attnserve.attention.ops.triton_decode import choose_num_splits, num_sms, paged_decode
    from attnserve.attention.ops.triton_prefill import paged_prefill

    _TRITON_ERROR: str | None = None
except ImportError as error:
    _TRITON_ERROR = f"triton cannot be imported: {error}"

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    """Device tensors cover every sequence of the step (prefills first, then decodes)."""

    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context + new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int  # longest prefill query (0 without prefills)
    max_prefill_context_len: int  # longest cached context of a prefill (0: prompts only)
    decode_num_splits: int  # key splits per decode sequence


class TritonMetadataBuilder(AttentionMetadataBuilder[TritonMetadata]):
    """The spec's `num_kv_heads` sizes the decode split plan."""

    _graph: DecodeGraphBuffers | None = None

    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        super().__init__(spec, device)
        self.num_sms = num_sms(self.device) if _TRITON_ERROR is None else 1
        self._fp8_cache = spec.kv_cache_dtype == "fp8"

    def build(self, layout: StepLayout) -> TritonMetadata:
        prefill_lens = layout.query_lens[: layout.num_prefills]
        prefill_context = layout.context_lens[: layout.num_prefills]
        decode_lens = layout.seq_lens[layout.num_prefills :]
        return TritonMetadata(
            **layout.common_metadata(self.device),
            block_table=int32_block_table(layout, self.device),
            seq_lens=int32_on(layout.seq_lens, self.device),
            query_start_loc=int32_on(layout.query_start_loc, self.device),
            max_query_len=int(prefill_lens.max()) if prefill_lens.numel() else 0,
            max_prefill_context_len=int(prefill_context.max()) if prefill_context.numel() else 0,
            decode_num_splits=self._num_splits(
                layout.num_decode_tokens, int(decode_lens.max()) if decode_lens.numel() else 0
            ),
        )

    def _num_splits(self, num_decodes: int, max_seq_len: int) -> int:
        return choose_num_splits(
            num_decodes, self.spec.num_kv_heads, max_seq_len, self.num_sms, self._fp8_cache
        )

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self._graph = DecodeGraphBuffers.allocate(
            max_num_seqs, max_blocks_per_seq, self.block_size, self.device
        )

    def build_for_graph(self, layout: StepLayout) -> TritonMetadata:
        """Plans the split count for the longest context: captured graphs serve any."""
        buffers = self._graph
        if buffers is None:
            raise RuntimeError("call init_graph_buffers before build_for_graph")
        return TritonMetadata(
            **buffers.fill(layout, self.device),
            max_query_len=0,
            max_prefill_context_len=0,
            decode_num_splits=self._num_splits(layout.num_seqs, buffers.max_seq_len),
        )


class TritonImpl(AttentionImpl[TritonMetadata]):
    """An fp8 cache reads its per-KV-head scales from `kv_scales` (the layer's; an operator
    made on its own gets unit scales on the device of its first call)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in TritonBackend.capabilities.kv_cache_dtypes:
            raise ValueError(f"TRITON does not support kv_cache_dtype {self.kv_cache_dtype!r}")
        self._slopes: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonMetadata,
    ) -> torch.Tensor:
        meta = attn_metadata
        dim = self.head_size
        k = key.view(-1, self.num_kv_heads, dim)
        v = value.view(-1, self.num_kv_heads, dim)
        params = self._params(query.device)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, params.kv_scales)
        q = query.view(-1, self.num_heads, dim)
        out = torch.empty(q.shape, dtype=query.dtype, device=query.device)
        prefill, decode = slice(0, meta.num_prefill_tokens), slice(meta.num_prefill_tokens, None)
        if meta.num_prefills:
            paged_prefill(
                q[prefill],
                k[prefill],
                v[prefill],
                kv_cache,
                meta.block_table[: meta.num_prefills],
                meta.seq_lens[: meta.num_prefills],
                meta.query_start_loc[: meta.num_prefills + 1],
                meta.max_query_len,
                out[prefill],
                params,
                max_context_len=meta.max_prefill_context_len,
            )
        if meta.num_decode_tokens:
            paged_decode(
                q[decode],
                kv_cache,
                meta.block_table[meta.num_prefills :],
                meta.seq_lens[meta.num_prefills :],
                out[decode],
                params,
                self._num_splits(meta.decode_num_splits),
            )
        return out.view(-1, self.num_heads * dim)

    def _num_splits(self, planned: int) -> int:
        """A sliding window bounds each decode's keys: no more splits than it can fill."""
        if self.sliding_window is None:
            return planned
        return max(1, min(planned, self.sliding_window // 256))

    def _params(self, device: torch.device) -> AttentionParams:
        slopes = None
        if self.alibi_slopes is not None:
            if device not in self._slopes:
                self._slopes[device] = to_device(self.alibi_slopes, device)
            slopes = self._slopes[device]
        return AttentionParams(
            scale=self.scale,
            sliding_window=self.sliding_window,
            alibi_slopes=slopes,
            soft_cap=self.logits_soft_cap,
            kv_scales=self._kv_scales(device),
        )

    def _kv_scales(self, device: torch.device) -> torch.Tensor | None:
        if self.kv_cache_dtype != "fp8":
            return None
        if self.kv_scales is None:
            self.kv_scales = KVCacheScales(self.num_kv_heads, device)
        return self.kv_scales.scales


class TritonBackend(AttentionBackend):
    name = "TRITON"
    impl_cls = TritonImpl
    builder_cls = TritonMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float16, torch.bfloat16, torch.float32),
        devices=("cuda", "cpu") if _INTERPRET else ("cuda",),
        head_sizes=(64, 80, 96, 128, 256),
        min_block_size=1,
        max_block_size=256,
        kv_cache_dtypes=("auto", "fp8"),
        sliding_window=True,
        alibi=True,
        logits_soft_cap=True,
        graphs=True,
        priority=-1 if _INTERPRET else 10,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if _TRITON_ERROR is not None:
            return _TRITON_ERROR
        if not torch.cuda.is_available() and not _INTERPRET:
            return "no CUDA GPU here, and the Triton interpreter (TRITON_INTERPRET=1) is off"
        return None
