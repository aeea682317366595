"""FLASHINFER: paged attention through the `flashinfer` package's batch wrappers (CUDA only).

KV layout (FlashInfer's HND, TRITON's too): [num_blocks, 2, num_kv_heads, block_size, head_size],
each KV head's page contiguous; new keys/values go in through the Triton cache write
(`triton_cache.reshape_and_cache`, which skips padding slots). The builder turns the step's
layout into FlashInfer's CSR page metadata (qo_indptr, kv_indptr, kv_indices, kv_last_page_len),
one set for the prefill sequences and one for the decodes, owns the workspace buffer and the
wrappers (BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper) and plans
them in `build`, from its spec (heads, head size, window, soft-cap, dtypes): the metadata
carries the planned wrappers, and every layer of the spec runs them. Plans use the default
scale 1/sqrt(head_size); a layer with another scale scales its queries to match.
Captured decode steps use the decode wrapper's CUDA-graph mode (see `WrapperPool`). Decodes
of GQA groups of 4 or more query heads per KV head run FlashInfer's tensor-core decode (what
FlashInfer and vLLM choose there); smaller groups its CUDA-core kernel. Kernels are compiled
just in time into attnserve's cache (~/.cache/attnserve/kernels/flashinfer, unless
FLASHINFER_WORKSPACE_BASE is set), once per machine, only the variants a model's specs need.

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
from attnserve.attention.backends.utils import import_failure, use_project_kernel_cache
from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device

try:
    from attnserve.attention.ops.triton_cache import reshape_and_cache

    _TRITON_ERROR: str | None = None
except ImportError as error:
    _TRITON_ERROR = f"triton (its KV-cache write) cannot be imported: {error}"

WORKSPACE_BYTES = 128 * 1024 * 1024
KV_LAYOUT = "HND"
# query heads per KV head from which decode runs FlashInfer's tensor-core (prefill) kernel: the
# CUDA-core decode kernel rereads each KV page once per query head group
TENSOR_CORE_MIN_GROUP = 4


def use_tensor_cores(spec: AttentionSpec) -> bool:
    """Whether decodes of `spec` take the tensor-core kernel (GQA groups of 4 or more)."""
    return spec.num_heads // spec.num_kv_heads >= TENSOR_CORE_MIN_GROUP


def _use_kernel_cache() -> None:
    """FlashInfer's JIT builds on disk in attnserve's cache (read at its import)."""
    use_project_kernel_cache("FLASHINFER_WORKSPACE_BASE", "flashinfer")


def _import_flashinfer() -> Any:
    """flashinfer, its JIT cache pointed into attnserve's cache (built once per machine)."""
    _use_kernel_cache()
    import flashinfer

    return flashinfer


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

    def __init__(self, device: torch.device, tensor_cores: bool) -> None:
        self.device, self.tensor_cores = device, tensor_cores
        self._workspace: torch.Tensor | None = None
        self._wrappers: tuple[Any, Any] | None = None
        self._graph_wrappers: dict[int, Any] = {}
        self.graph_kv_indices: torch.Tensor | None = None

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def get(self, graph_size: int | None = None) -> tuple[Any, Any]:
        if self._wrappers is None:
            flashinfer = _import_flashinfer()
            self._wrappers = (
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(), KV_LAYOUT),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace(), KV_LAYOUT, use_tensor_cores=self.tensor_cores
                ),
            )
        if graph_size is None:
            return self._wrappers
        if graph_size not in self._graph_wrappers:
            self._graph_wrappers[graph_size] = self._graph_decode_wrapper(graph_size)
        return self._wrappers[0], self._graph_wrappers[graph_size]

    def _graph_decode_wrapper(self, graph_size: int) -> Any:
        return _import_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(),
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores,
            paged_kv_indptr_buffer=self._int32_buffer(graph_size + 1),
            paged_kv_indices_buffer=self.graph_kv_indices,
            paged_kv_last_page_len_buffer=self._int32_buffer(graph_size),
        )

    def _int32_buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int32, device=self.device)


@dataclass(frozen=True)
class FlashInferMetadata(AttentionMetadata):
    prefill: PagedGroup | None
    decode: PagedGroup | None
    prefill_wrapper: Any  # planned for `prefill` (unused without prefills)
    decode_wrapper: Any  # planned for `decode` (unused without decodes)


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


class FlashInferMetadataBuilder(AttentionMetadataBuilder[FlashInferMetadata]):
    """Plans its pool's wrappers for its spec in every `build`, once per step for every layer
    of the spec, on the host, outside any captured graph."""

    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        super().__init__(spec, device)
        self.pool = WrapperPool(self.device, use_tensor_cores(spec))
        kv_dtype = FlashInferBackend.get_kv_cache_torch_dtype(spec.kv_cache_dtype, spec.dtype)
        self.planner = Planner(spec, kv_dtype)
        self._graph_slot_mapping: torch.Tensor | None = None

    def build(self, layout: StepLayout) -> FlashInferMetadata:
        return self._planned(layout, layout.common_metadata(self.device), self.pool.get())

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self._graph_slot_mapping = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self.pool.graph_kv_indices = torch.zeros(
            max_num_seqs * max_blocks_per_seq, dtype=torch.int32, device=self.device
        )

    def build_for_graph(self, layout: StepLayout) -> FlashInferMetadata:
        """Padded decode metadata: the slot mapping goes into its fixed buffer, and the bucket's
        graph decode wrapper is planned (into its fixed buffers) before the replay."""
        if self._graph_slot_mapping is None:
            raise RuntimeError("call init_graph_buffers before build_for_graph")
        slot_mapping = self._graph_slot_mapping[: layout.num_seqs]
        slot_mapping.copy_(layout.slot_mapping, non_blocking=True)
        common = {**layout.common_metadata(self.device), "slot_mapping": slot_mapping}
        return self._planned(layout, common, self.pool.get(layout.num_seqs))

    def _planned(
        self, layout: StepLayout, common: dict[str, Any], wrappers: tuple[Any, Any]
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
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
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
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed"
        if _TRITON_ERROR is not None:
            return _TRITON_ERROR
        _use_kernel_cache()
        return import_failure("flashinfer")
