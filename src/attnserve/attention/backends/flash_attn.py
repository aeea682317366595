"""FLASH_ATTN: FlashAttention's Hopper and Blackwell kernels (the `flash-attn-4` package, its
CuTe-DSL build, compiled just in time) over the paged KV cache. CUDA, compute capability 9.0+.

KV layout (FlashAttention's paged one): [num_blocks, 2, block_size, num_kv_heads, head_size]:
each block holds its K page then its V page, token-major; `kv_cache[:, 0]` and `kv_cache[:, 1]`
are the paged `k` and `v` that `flash_attn_varlen_func` reads through its `page_table` (the
step's block table). New keys/values go in through the Triton cache write
(`triton_cache.reshape_and_cache`) on the cache's head-major view.

One varlen call runs the whole step, prefills (cached prefixes included: `seqused_k` is context
plus new tokens) and decodes alike: causal masking aligned to each sequence's last key, a
sliding window as window_size (W - 1, 0), logits soft-cap; the library picks its tiles, GQA
packing and key splits. Captured decode steps read fixed buffers, planned for the longest
context (the library's split choice must cover every replay). Not ALiBi (no slopes argument)
and no fp8 cache. Kernels are compiled into attnserve's cache (~/.cache/attnserve/kernels/
flash_attn, unless FLASH_ATTENTION_CUTE_DSL_CACHE_DIR is set), once per machine and variant.
`flash_attn` is imported lazily, so this module imports (and reports itself unavailable)
without it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    BackendCapabilities,
)
from attnserve.attention.backends.utils import (
    DecodeGraphBuffers,
    import_failure,
    int32_block_table,
    int32_on,
    use_project_kernel_cache,
)
from attnserve.attention.layout import StepLayout

try:
    from attnserve.attention.ops.triton_cache import reshape_and_cache

    _TRITON_ERROR: str | None = None
except ImportError as error:
    _TRITON_ERROR = f"triton (its KV-cache write) cannot be imported: {error}"

MIN_COMPUTE_CAPABILITY = 9
_KERNEL_MODULE = "flash_attn.cute"  # flash-attn-4's CuTe-DSL build


@dataclass(frozen=True)
class FlashAttnMetadata(AttentionMetadata):
    """Device tensors cover every sequence of the step (prefills first, then decodes)."""

    block_table: torch.Tensor  # [B, max_blocks] int32: the page table
    seq_lens: torch.Tensor  # [B] int32: context + new tokens (seqused_k)
    query_start_loc: torch.Tensor  # [B + 1] int32 (cu_seqlens_q)
    max_query_len: int
    max_seq_len: int


class FlashAttnMetadataBuilder(AttentionMetadataBuilder[FlashAttnMetadata]):
    _graph: DecodeGraphBuffers | None = None

    def build(self, layout: StepLayout) -> FlashAttnMetadata:
        return FlashAttnMetadata(
            **layout.common_metadata(self.device),
            block_table=int32_block_table(layout, self.device),
            seq_lens=int32_on(layout.seq_lens, self.device),
            query_start_loc=int32_on(layout.query_start_loc, self.device),
            max_query_len=int(layout.query_lens.max()),
            max_seq_len=int(layout.seq_lens.max()),
        )

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self._graph = DecodeGraphBuffers.allocate(
            max_num_seqs, max_blocks_per_seq, self.block_size, self.device
        )

    def build_for_graph(self, layout: StepLayout) -> FlashAttnMetadata:
        """The longest context is the key-length bound: the library's split choice at capture
        must serve every replay."""
        buffers = self._graph
        if buffers is None:
            raise RuntimeError("call init_graph_buffers before build_for_graph")
        return FlashAttnMetadata(
            **buffers.fill(layout, self.device), max_query_len=1, max_seq_len=buffers.max_seq_len
        )


def _use_kernel_cache() -> None:
    """FlashAttention's compiled kernels on disk in attnserve's cache (read at its import)."""
    use_project_kernel_cache("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "flash_attn")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")


@functools.cache
def _varlen_attention() -> Any:
    """flash_attn_varlen_func, its kernels cached on disk in attnserve's cache (looked up once:
    every layer of every step calls it)."""
    _use_kernel_cache()
    return importlib.import_module(_KERNEL_MODULE).flash_attn_varlen_func


class FlashAttnImpl(AttentionImpl[FlashAttnMetadata]):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.alibi_slopes is not None:
            raise ValueError("FLASH_ATTN does not support ALiBi")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"FLASH_ATTN does not support kv_cache_dtype {self.kv_cache_dtype!r}")
        left = None if self.sliding_window is None else self.sliding_window - 1
        self.window_size = (left, None if left is None else 0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        meta, heads, dim = attn_metadata, self.num_kv_heads, self.head_size
        k, v = key.view(-1, heads, dim), value.view(-1, heads, dim)
        reshape_and_cache(k, v, kv_cache.transpose(2, 3), meta.slot_mapping)
        out, _ = _varlen_attention()(
            query.view(-1, self.num_heads, dim),
            kv_cache[:, 0],
            kv_cache[:, 1],
            cu_seqlens_q=meta.query_start_loc,
            seqused_k=meta.seq_lens,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            page_table=meta.block_table,
            softmax_scale=self.scale,
            causal=True,
            window_size=self.window_size,
            softcap=self.logits_soft_cap or 0.0,
            num_splits=0,  # the library's choice
        )
        return out.view(-1, self.num_heads * dim)


class FlashAttnBackend(AttentionBackend):
    name = "FLASH_ATTN"
    impl_cls = FlashAttnImpl
    builder_cls = FlashAttnMetadataBuilder
    capabilities = BackendCapabilities(
        dtypes=(torch.float16, torch.bfloat16),
        devices=("cuda",),
        head_sizes=(64, 80, 96, 128, 256),
        min_block_size=1,
        max_block_size=256,
        sliding_window=True,
        alibi=False,
        logits_soft_cap=True,
        graphs=True,
        priority=1,
    )

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("flash_attn") is None:
            return "flash-attn-4 is not installed (pip install flash-attn-4)"
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "the installed flash_attn has no CuTe build (pip install flash-attn-4)"
        if not torch.cuda.is_available():
            return "no CUDA GPU here"
        major, minor = torch.cuda.get_device_capability()
        if major < MIN_COMPUTE_CAPABILITY:
            return f"needs compute capability 9.0 or newer, this GPU is {major}.{minor}"
        if _TRITON_ERROR is not None:
            return _TRITON_ERROR
        _use_kernel_cache()
        return import_failure(_KERNEL_MODULE)
