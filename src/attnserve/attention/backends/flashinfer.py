"""FLASHINFER: paged attention through the `flashinfer` package's batch wrappers (CUDA only).

KV layout (FlashInfer's NHD): [num_blocks, 2, block_size, num_kv_heads, head_size]. The builder
turns the step's block tables into FlashInfer's CSR page metadata (qo_indptr, kv_indptr,
kv_indices, kv_last_page_len), one set for the prefill sequences and one for the decodes, and
owns the workspace buffer and the wrappers (BatchPrefillWithPagedKVCacheWrapper,
BatchDecodeWithPagedKVCacheWrapper). The wrappers are planned once per step, on the first
layer's call (plan needs the layer's heads, scale, window and soft-cap), and the planned pair
is cached in the metadata for the step's other layers. Captured decode steps use the
decode wrapper's CUDA-graph mode (see `WrapperPool`).

Features, as flashinfer 0.6.1's paged wrappers provide them: sliding window (window_left) and
logits soft-cap, in fp16/bf16, head sizes 64/128/256. Not ALiBi: the wrappers apply a fixed
slope table of their own (no per-model slopes) and add the bias before soft-capping, the
reverse of this project's contract.
`flashinfer` is imported lazily, so this module imports (and reports itself unavailable)
without it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    BackendCapabilities,
)
from attnserve.attention.backends.layout import StepLayout, build_step_layout, pad_decode_step
from attnserve.host_copy import to_device

WORKSPACE_BYTES = 128 * 1024 * 1024

# (num_heads, num_kv_heads, head_size, scale, window_left, soft_cap, q dtype, kv dtype)
PlanKey = tuple[int, int, int, float, int, float | None, torch.dtype, torch.dtype]


@dataclass(frozen=True)
class PagedGroup:
    """FlashInfer's CSR view of some sequences of the step (int32; on the host, except the page
    ids: `plan` copies those into its buffers, without a stream sync only from the device)."""

    token_slice: slice  # the group's new tokens in the flat batch
    qo_indptr: torch.Tensor  # [B + 1] offsets of each sequence's new tokens in the group
    kv_indptr: torch.Tensor  # [B + 1] offsets of each sequence's pages in kv_indices
    kv_indices: torch.Tensor  # [sum pages] physical page ids, sequence by sequence (device)
    kv_last_page_len: torch.Tensor  # [B] tokens in each sequence's last page (1..block_size)


class WrapperPool:
    """One workspace and one (prefill, decode) wrapper pair per plan configuration; lives as
    long as the builder, so buffers are allocated once, not per step.

    Captured decode steps get their own decode wrappers in FlashInfer's CUDA-graph mode, one
    per (configuration, bucket size), whose page metadata lives in fixed device buffers that
    `plan` refills before each replay; `graph_keys` remembers which configurations each
    bucket's graph runs, so they can be planned before the replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[PlanKey, tuple[Any, Any]] = {}
        self._graph_wrappers: dict[tuple[PlanKey, int], Any] = {}
        self.graph_kv_indices: torch.Tensor | None = None
        self.graph_keys: dict[int, set[PlanKey]] = {}

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def get(self, key: PlanKey, graph_size: int | None = None) -> tuple[Any, Any]:
        import flashinfer

        if key not in self._wrappers:
            self._wrappers[key] = (
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(), "NHD"),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace(), "NHD"),
            )
        if graph_size is None:
            return self._wrappers[key]
        if (key, graph_size) not in self._graph_wrappers:
            self._graph_wrappers[key, graph_size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace(),
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self._int32_buffer(graph_size + 1),
                paged_kv_indices_buffer=self.graph_kv_indices,
                paged_kv_last_page_len_buffer=self._int32_buffer(graph_size),
            )
            self.graph_keys.setdefault(graph_size, set()).add(key)
        return self._wrappers[key][0], self._graph_wrappers[key, graph_size]

    def _int32_buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int32, device=self.device)


@dataclass
class FlashInferMetadata(AttentionMetadata):
    block_size: int
    prefill: PagedGroup | None
    decode: PagedGroup | None
    pool: WrapperPool
    graph_size: int | None = None  # the capture bucket of a graph-ready decode step
    planned: dict[PlanKey, tuple[Any, Any]] = field(default_factory=dict)
    writes: SlotWrites | None = field(default=None, init=False)  # made by the first layer

    def slot_writes(self) -> SlotWrites:
        """The step's cache-write indices, derived once from `slot_mapping` for all layers."""
        if self.writes is None:
            self.writes = SlotWrites.from_slot_mapping(self.slot_mapping, self.block_size)
        return self.writes

    def wrappers(self, key: PlanKey) -> tuple[Any, Any]:
        """The (prefill, decode) wrappers planned for this step and configuration."""
        if key not in self.planned:
            prefill, decode = self.pool.get(key, self.graph_size)
            if self.prefill is not None:
                self._plan_prefill(prefill, self.prefill, key)
            if self.decode is not None:
                self._plan_decode(decode, self.decode, key)
            self.planned[key] = (prefill, decode)
        return self.planned[key]

    def _plan_prefill(self, wrapper: Any, group: PagedGroup, key: PlanKey) -> None:
        num_heads, num_kv_heads, head_size, scale, window_left, cap, q_dtype, kv_dtype = key
        wrapper.plan(
            group.qo_indptr,
            group.kv_indptr,
            group.kv_indices,
            group.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_size,
            self.block_size,
            causal=True,
            pos_encoding_mode="NONE",
            sm_scale=scale,
            window_left=window_left,
            logits_soft_cap=cap,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )

    def _plan_decode(self, wrapper: Any, group: PagedGroup, key: PlanKey) -> None:
        num_heads, num_kv_heads, head_size, scale, window_left, cap, q_dtype, kv_dtype = key
        wrapper.plan(
            group.kv_indptr,
            group.kv_indices,
            group.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_size,
            self.block_size,
            pos_encoding_mode="NONE",
            window_left=window_left,
            logits_soft_cap=cap,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
            sm_scale=scale,
        )


def _paged_group(
    layout: StepLayout, seqs: range, block_size: int, device: torch.device
) -> PagedGroup | None:
    if len(seqs) == 0:
        return None
    loc = layout.query_start_loc[seqs.start : seqs.stop + 1]
    return _csr(
        slice(int(loc[0]), int(loc[-1])),
        loc - loc[0],
        layout.block_table[seqs.start : seqs.stop],
        layout.seq_lens[seqs.start : seqs.stop],
        block_size,
        device,
    )


def _csr(
    token_slice: slice,
    qo_indptr: torch.Tensor,
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> PagedGroup:
    """FlashInfer's page metadata of sequences with block table rows `table` [B, W]."""
    num_pages = -(-seq_lens // block_size)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=kv_indptr[1:])
    used = torch.arange(table.shape[1])[None, :] < num_pages[:, None]
    return PagedGroup(
        token_slice=token_slice,
        qo_indptr=qo_indptr.to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=to_device(table[used].to(torch.int32), device),
        kv_last_page_len=((seq_lens - 1) % block_size + 1).to(torch.int32),
    )


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    def __init__(self, block_size: int, device: torch.device | str, **kwargs: Any) -> None:
        super().__init__(block_size, device, **kwargs)
        self.pool = WrapperPool(self.device)

    def build(
        self,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        query_lens: Sequence[int],
    ) -> FlashInferMetadata:
        layout = build_step_layout(block_tables, context_lens, query_lens, self.block_size)
        return FlashInferMetadata(
            **layout.common_metadata(self.device),
            block_size=self.block_size,
            prefill=_paged_group(
                layout, range(0, layout.num_prefills), self.block_size, self.device
            ),
            decode=_paged_group(
                layout, range(layout.num_prefills, layout.num_seqs), self.block_size, self.device
            ),
            pool=self.pool,
        )

    def init_cuda_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.graph_slot_mapping = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self.pool.graph_kv_indices = torch.zeros(
            max_num_seqs * max_blocks_per_seq, dtype=torch.int32, device=self.device
        )

    def build_for_cuda_graph(
        self,
        num_padded_seqs: int,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
    ) -> FlashInferMetadata:
        """Padded decode metadata; re-plans (into the bucket's fixed buffers) every
        configuration that this bucket's graph was captured with."""
        if self.pool.graph_kv_indices is None:
            raise RuntimeError("call init_cuda_graph_buffers before build_for_cuda_graph")
        step = pad_decode_step(block_tables, context_lens, num_padded_seqs, self.block_size)
        slot_mapping = self.graph_slot_mapping[:num_padded_seqs]
        slot_mapping.copy_(step.slot_mapping, non_blocking=True)
        metadata = FlashInferMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=num_padded_seqs,
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            prefill=None,
            decode=_csr(
                slice(0, num_padded_seqs),
                torch.arange(num_padded_seqs + 1),
                step.block_table,
                step.seq_lens,
                self.block_size,
                self.device,
            ),
            pool=self.pool,
            graph_size=num_padded_seqs,
        )
        for key in self.pool.graph_keys.get(num_padded_seqs, ()):
            metadata.wrappers(key)
        return metadata


@dataclass(frozen=True)
class SlotWrites:
    """Where each new token's key/value goes in the NHD cache, with no host sync for slot -1:
    a padding token rewrites the first real token's slot with that token's own values (when
    no token is real, everything rewrites slot 0 with its current contents)."""

    source: torch.Tensor  # [T] the token whose key/value is written
    blocks: torch.Tensor  # [T] target block
    offsets: torch.Tensor  # [T] target offset in the block
    keep_old: torch.Tensor  # [T, 1, 1] true only when no token is real

    @classmethod
    def from_slot_mapping(cls, slot_mapping: torch.Tensor, block_size: int) -> SlotWrites:
        real = slot_mapping >= 0
        first_real = torch.argmax(real.to(torch.int32))  # 0 when no token is real
        tokens = torch.arange(slot_mapping.shape[0], device=real.device)
        source = torch.where(real, tokens, first_real)
        slots = slot_mapping[source]
        target = slots.clamp(min=0)
        return cls(source, target // block_size, target % block_size, (slots < 0)[:, None, None])

    def write(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        for half, new in ((0, key), (1, value)):
            rows = new.view(-1, *kv_cache.shape[3:])[self.source].to(kv_cache.dtype)
            old = kv_cache[self.blocks, half, self.offsets]
            kv_cache[self.blocks, half, self.offsets] = torch.where(self.keep_old, old, rows)


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None:
            raise ValueError("FLASHINFER does not support ALiBi (see the module docstring)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        attn_metadata.slot_writes().write(kv_cache, key, value)
        q = query.view(-1, self.num_heads, self.head_size)
        out = torch.empty_like(q)
        prefill, decode = attn_metadata.wrappers(self._plan_key(q.dtype, kv_cache.dtype))
        for group, wrapper in ((attn_metadata.prefill, prefill), (attn_metadata.decode, decode)):
            if group is not None:
                tokens = group.token_slice
                wrapper.run(q[tokens], kv_cache, out=out[tokens])
        return out.view(-1, self.num_heads * self.head_size)

    def _plan_key(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> PlanKey:
        window_left = -1 if self.sliding_window is None else self.sliding_window - 1
        return (
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.scale,
            window_left,
            self.logits_soft_cap,
            q_dtype,
            kv_dtype,
        )


class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    impl_cls = FlashInferImpl
    metadata_cls = FlashInferMetadata
    builder_cls = FlashInferMetadataBuilder
    kv_cache_block_dim = 0
    capabilities = BackendCapabilities(
        dtypes=(torch.float16, torch.bfloat16),
        devices=("cuda",),
        head_sizes=(64, 128, 256),
        min_block_size=1,
        max_block_size=256,
        sliding_window=True,
        alibi=False,
        logits_soft_cap=True,
        cuda_graphs=True,
        priority=5,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed"
        return None
