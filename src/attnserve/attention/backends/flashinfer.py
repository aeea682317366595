"""FLASHINFER: paged attention through the `flashinfer` package's batch wrappers (CUDA only).

KV layout (FlashInfer's NHD): [num_blocks, 2, block_size, num_kv_heads, head_size]. The builder
turns the step's layout into FlashInfer's CSR page metadata (qo_indptr, kv_indptr, kv_indices,
kv_last_page_len), one set for the prefill sequences and one for the decodes, owns the workspace
buffer and the wrappers (BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper)
and plans them in `build`, from its spec (heads, head size, window, soft-cap, dtypes): the
metadata carries the planned wrappers, and every layer of the spec runs them. Plans use the
default scale 1/sqrt(head_size); a layer with another scale scales its queries to match.
Captured decode steps use the decode wrapper's CUDA-graph mode (see `WrapperPool`).

Features, as flashinfer 0.6.1's paged wrappers provide them: sliding window (window_left) and
logits soft-cap, in fp16/bf16, head sizes 64/128/256. Not ALiBi: the wrappers apply a fixed
slope table of their own (no per-model slopes) and add the bias before soft-capping, the
reverse of this project's contract.
`flashinfer` is imported lazily, so this module imports (and reports itself unavailable)
without it.
"""

from __future__ import annotations

import importlib.util
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
from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device

WORKSPACE_BYTES = 128 * 1024 * 1024


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
    """One workspace and one (prefill, decode) wrapper pair, for one builder's spec; lives as
    long as the builder, so buffers are allocated once, not per step.

    Captured decode steps get their own decode wrapper in FlashInfer's CUDA-graph mode, one per
    bucket size, whose page metadata lives in fixed device buffers that `plan` refills before
    each replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._workspace: torch.Tensor | None = None
        self._wrappers: tuple[Any, Any] | None = None
        self._graph_wrappers: dict[int, Any] = {}
        self.graph_kv_indices: torch.Tensor | None = None

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def get(self, graph_size: int | None = None) -> tuple[Any, Any]:
        import flashinfer

        if self._wrappers is None:
            self._wrappers = (
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(), "NHD"),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace(), "NHD"),
            )
        if graph_size is None:
            return self._wrappers
        if graph_size not in self._graph_wrappers:
            self._graph_wrappers[graph_size] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace(),
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=self._int32_buffer(graph_size + 1),
                paged_kv_indices_buffer=self.graph_kv_indices,
                paged_kv_last_page_len_buffer=self._int32_buffer(graph_size),
            )
        return self._wrappers[0], self._graph_wrappers[graph_size]

    def _int32_buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int32, device=self.device)


@dataclass(frozen=True)
class FlashInferMetadata(AttentionMetadata):
    prefill: PagedGroup | None
    decode: PagedGroup | None
    prefill_wrapper: Any  # planned for `prefill` (unused without prefills)
    decode_wrapper: Any  # planned for `decode` (unused without decodes)
    writes: SlotWrites  # where each new token's key/value goes


class Planner:
    """Plans a builder's wrappers for its spec (FlashInfer's `plan` arguments)."""

    def __init__(self, spec: AttentionSpec, kv_dtype: torch.dtype) -> None:
        self.spec, self.kv_dtype = spec, kv_dtype
        self.window_left = -1 if spec.sliding_window is None else spec.sliding_window - 1

    def _features(self) -> dict[str, Any]:
        return {
            "pos_encoding_mode": "NONE",
            "sm_scale": self.spec.head_size**-0.5,
            "window_left": self.window_left,
            "logits_soft_cap": self.spec.logits_soft_cap,
            "q_data_type": self.spec.dtype,
            "kv_data_type": self.kv_dtype,
        }

    def _heads(self) -> tuple[int, int, int, int]:
        spec = self.spec
        return spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size

    def plan_prefill(self, wrapper: Any, group: PagedGroup) -> None:
        csr = (group.qo_indptr, group.kv_indptr, group.kv_indices, group.kv_last_page_len)
        wrapper.plan(*csr, *self._heads(), causal=True, **self._features())

    def plan_decode(self, wrapper: Any, group: PagedGroup) -> None:
        csr = (group.kv_indptr, group.kv_indices, group.kv_last_page_len)
        wrapper.plan(*csr, *self._heads(), **self._features())


def paged_groups(
    layout: StepLayout, block_size: int, device: torch.device
) -> tuple[PagedGroup | None, PagedGroup | None]:
    """The CSR page metadata of the layout's prefill sequences and of its decodes."""
    return (
        _paged_group(layout, range(0, layout.num_prefills), block_size, device),
        _paged_group(layout, range(layout.num_prefills, layout.num_seqs), block_size, device),
    )


def _paged_group(
    layout: StepLayout, seqs: range, block_size: int, device: torch.device
) -> PagedGroup | None:
    """FlashInfer's page metadata of the layout's sequences `seqs` (consecutive)."""
    if len(seqs) == 0:
        return None
    loc = layout.query_start_loc[seqs.start : seqs.stop + 1]
    table = layout.block_table[seqs.start : seqs.stop]
    seq_lens = layout.seq_lens[seqs.start : seqs.stop]
    num_pages = -(-seq_lens // block_size)
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=kv_indptr[1:])
    used = torch.arange(table.shape[1])[None, :] < num_pages[:, None]
    return PagedGroup(
        token_slice=slice(int(loc[0]), int(loc[-1])),
        qo_indptr=(loc - loc[0]).to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=to_device(table[used].to(torch.int32), device),
        kv_last_page_len=((seq_lens - 1) % block_size + 1).to(torch.int32),
    )


@dataclass(frozen=True)
class SlotWrites:
    """Where each new token's key/value goes in the NHD cache, computed on the host and with a
    fixed shape for slot -1: a padding token rewrites the first real token's slot with that
    token's own values (when no token is real, everything rewrites slot 0 with its current
    contents)."""

    source: torch.Tensor  # [T] the token whose key/value is written
    blocks: torch.Tensor  # [T] target block
    offsets: torch.Tensor  # [T] target offset in the block
    keep_old: torch.Tensor  # [T, 1, 1] true only when no token is real

    @classmethod
    def from_slot_mapping(cls, slot_mapping: torch.Tensor, block_size: int) -> SlotWrites:
        real = slot_mapping >= 0
        first_real = torch.argmax(real.to(torch.int32))  # 0 when no token is real
        tokens = torch.arange(slot_mapping.shape[0])
        source = torch.where(real, tokens, first_real)
        slots = slot_mapping[source]
        target = slots.clamp(min=0)
        return cls(source, target // block_size, target % block_size, (slots < 0)[:, None, None])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.source, self.blocks, self.offsets, self.keep_old

    def write(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        for half, new in ((0, key), (1, value)):
            rows = new.view(-1, *kv_cache.shape[3:])[self.source].to(kv_cache.dtype)
            old = kv_cache[self.blocks, half, self.offsets]
            kv_cache[self.blocks, half, self.offsets] = torch.where(self.keep_old, old, rows)


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans its pool's wrappers for its spec in every `build`."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        super().__init__(spec, device)
        self.pool = WrapperPool(self.device)
        kv_dtype = FlashInferBackend.get_kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
        self.planner = Planner(spec, kv_dtype)
        self._graph_writes: SlotWrites | None = None
        self._graph_slot_mapping: torch.Tensor | None = None

    def build(self, layout: StepLayout) -> FlashInferMetadata:
        writes = SlotWrites.from_slot_mapping(layout.slot_mapping, self.block_size)
        device_writes = SlotWrites(*(to_device(t, self.device) for t in writes.tensors()))
        common = layout.common_metadata(self.device)
        return self._planned(layout, common, self.pool.get(), device_writes)

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        self._graph_slot_mapping = zeros(max_num_seqs)
        self._graph_writes = SlotWrites(
            zeros(max_num_seqs),
            zeros(max_num_seqs),
            zeros(max_num_seqs),
            zeros(max_num_seqs, 1, 1, dtype=torch.bool),
        )
        self.pool.graph_kv_indices = zeros(max_num_seqs * max_blocks_per_seq, dtype=torch.int32)

    def build_for_graph(self, layout: StepLayout) -> FlashInferMetadata:
        """Padded decode metadata: the slot writes go into the fixed buffers, and the bucket's
        graph decode wrapper is planned (into its fixed buffers) before the replay."""
        buffers, slot_buffer = self._graph_writes, self._graph_slot_mapping
        if buffers is None or slot_buffer is None:
            raise RuntimeError("call init_graph_buffers before build_for_graph")
        size = layout.num_seqs
        host = SlotWrites.from_slot_mapping(layout.slot_mapping, self.block_size)
        writes = SlotWrites(*(t[:size] for t in buffers.tensors()))
        for buffer, values in zip(writes.tensors(), host.tensors(), strict=True):
            buffer.copy_(values, non_blocking=True)
        slot_mapping = slot_buffer[:size]
        slot_mapping.copy_(layout.slot_mapping, non_blocking=True)
        common = {**layout.common_metadata(self.device), "slot_mapping": slot_mapping}
        return self._planned(layout, common, self.pool.get(size), writes)

    def _planned(
        self,
        layout: StepLayout,
        common: dict[str, Any],
        wrappers: tuple[Any, Any],
        writes: SlotWrites,
    ) -> FlashInferMetadata:
        prefill, decode = paged_groups(layout, self.block_size, self.device)
        if prefill is not None:
            self.planner.plan_prefill(wrappers[0], prefill)
        if decode is not None:
            self.planner.plan_decode(wrappers[1], decode)
        return FlashInferMetadata(
            **common,
            prefill=prefill,
            decode=decode,
            prefill_wrapper=wrappers[0],
            decode_wrapper=wrappers[1],
            writes=writes,
        )


class FlashInferImpl(AttentionImpl[FlashInferMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None:
            raise ValueError("FLASHINFER does not support ALiBi (see the module docstring)")
        # the plans use 1/sqrt(head_size): another scale is folded into the queries
        self.query_scale = self.scale / self.head_size**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashInferMetadata,
    ) -> torch.Tensor:
        meta = attn_metadata
        meta.writes.write(kv_cache, key, value)
        q = query.view(-1, self.num_heads, self.head_size)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        out = torch.empty_like(q)
        for group, wrapper in (
            (meta.prefill, meta.prefill_wrapper),
            (meta.decode, meta.decode_wrapper),
        ):
            if group is not None:
                tokens = group.token_slice
                wrapper.run(q[tokens], kv_cache, out=out[tokens])
        return out.view(-1, self.num_heads * self.head_size)


class FlashInferBackend(AttentionBackend):
    name = "FLASHINFER"
    impl_cls = FlashInferImpl
    builder_cls = FlashInferMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float16, torch.bfloat16),
        devices=("cuda",),
        head_sizes=(64, 128, 256),
        min_block_size=1,
        max_block_size=256,
        sliding_window=True,
        alibi=False,
        logits_soft_cap=True,
        graphs=True,
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
