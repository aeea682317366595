"""The attention-backend contract: Backend (static facts), Metadata, Builder and Impl.

A backend owns everything layout-specific: the KV-cache shape, moving cache blocks, the per-step
metadata its kernels need (built by its `AttentionMetadataBuilder` from the step's `StepLayout`)
and the attention operator itself. Nothing outside `attention/backends/` sees any of it.

`AttentionSpec` is the one description of a kind of attention layer: the model runner builds it
from the model's layers, the selector matches it against capabilities, and each builder is made
for one spec (`builder_cls(spec, device)`), so it knows the heads, window and soft-cap it plans
for. Metadata is frozen: one object serves every layer of that spec in a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from attnserve.attention.kv_scales import KVCacheScales

if TYPE_CHECKING:
    from attnserve.attention.layout import StepLayout


def check_window_and_cap(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")


@dataclass(frozen=True)
class AttentionSpec:
    """What one kind of attention layer needs of a backend (heads are this rank's share)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    device: str = "cpu"
    sliding_window: int | None = None
    use_alibi: bool = False
    logits_soft_cap: float | None = None
    kv_cache_group: int = 0  # the layer's KV-cache group: whose block table it reads

    def __post_init__(self) -> None:
        group = self.kv_cache_group
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise ValueError(f"AttentionSpec.kv_cache_group must be an int >= 0, got {group!r}")
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AttentionSpec.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"AttentionSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        check_window_and_cap(self.sliding_window, self.logits_soft_cap)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. `None` for head_sizes means any head size."""

    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    head_sizes: tuple[int, ...] | None = None
    min_block_size: int = 1
    max_block_size: int = 256
    block_size_multiple: int = 1
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    sliding_window: bool = False
    alibi: bool = False
    logits_soft_cap: bool = False
    graphs: bool = False
    priority: int = 0

    def unsupported_reasons(self, spec: AttentionSpec) -> list[str]:
        """Every way `spec` falls outside these capabilities (empty when it is supported)."""
        checks = [
            (spec.device in self.devices, f"device {spec.device!r} not in {self.devices}"),
            (spec.dtype in self.dtypes, f"dtype {spec.dtype} not in {self.dtypes}"),
            (
                self.head_sizes is None or spec.head_size in self.head_sizes,
                f"head size {spec.head_size} not in {self.head_sizes}",
            ),
            (
                self.min_block_size <= spec.block_size <= self.max_block_size
                and spec.block_size % self.block_size_multiple == 0,
                f"block size {spec.block_size} not in {self.min_block_size}.."
                f"{self.max_block_size} (multiple of {self.block_size_multiple})",
            ),
            (
                spec.kv_cache_dtype in self.kv_cache_dtypes,
                f"kv_cache_dtype {spec.kv_cache_dtype!r} not in {self.kv_cache_dtypes}",
            ),
            (self.sliding_window or spec.sliding_window is None, "no sliding window support"),
            (self.alibi or not spec.use_alibi, "no ALiBi support"),
            (self.logits_soft_cap or spec.logits_soft_cap is None, "no logits soft-cap support"),
        ]
        return [reason for ok, reason in checks if not ok]


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step inputs common to every backend; backends subclass it (frozen too) with their own
    fields. `AttentionImpl.forward` never changes it, so one object serves any number of forwards.

    The batch holds `num_prefills` prefill sequences first (their `num_prefill_tokens` new
    tokens), then decode sequences (one new token each). `slot_mapping[t]` is the flat cache slot
    (block_id * block_size + offset) where new token t's key/value go; -1 marks padding.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


M = TypeVar("M", bound=AttentionMetadata)


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Turns one step's `StepLayout` into one backend's metadata, for the layers of one spec.

    The model runner makes one builder per distinct `AttentionSpec` of the model
    (`builder_cls(spec, device)`) and calls `build` once per step with the step's layout, which
    it computes once for all builders (`build_step_layout`). A backend that plans its kernels
    (page tables, work partitions) does so here, so `AttentionImpl.forward` only reads metadata.
    """

    def __init__(self, spec: AttentionSpec, device: torch.device | str) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.device = torch.device(device)

    @abstractmethod
    def build(self, layout: StepLayout) -> M:
        """Return the metadata for one step."""

    def init_graph_buffers(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Allocate the persistent buffers that captured decode steps read (CUDA or CPU graphs);
        called once, before any `build_for_graph`. Only backends whose capabilities declare
        `graphs` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not support graphs")

    def build_for_graph(self, layout: StepLayout) -> M:
        """Metadata for a decode-only step padded to a capture bucket (the graph runners'
        `pad_for_graph`: `layout.num_seqs` is the bucket), written into the persistent buffers
        in place.

        Every call for the same bucket must return metadata whose tensors are the same buffers
        and whose host values (and so the kernels' launch shapes) are the same, so a graph
        captured with one call replays correctly after another. Padding sequences write
        nothing (slot -1) and their outputs are ignored.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support graphs")


class AttentionImpl(ABC, Generic[M]):
    """The attention operator of one layer: writes the new K/V, then attends.

    `kv_scales`: an fp8 cache's scales (`KVCacheScales`, the layer's own, calibrated by the
    model runner); a backend that serves fp8 caches makes unit scales where none are given."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: KVCacheScales | None = None,
    ) -> None:
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        check_window_and_cap(sliding_window, logits_soft_cap)
        slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes).float()
        if slopes is not None and slopes.shape != (num_heads,):
            raise ValueError(f"alibi_slopes must have {num_heads} entries, got {slopes.shape}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.alibi_slopes = slopes
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_scales = kv_scales

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: M,
    ) -> torch.Tensor:
        """query [T, num_heads*head_size], key/value [T, num_kv_heads*head_size] -> [T, H*D]."""


class AttentionBackend(ABC):
    """Static facts about one backend, and its dispatch to Impl, Metadata and Builder.

    A backend declares its classes and facts as class attributes (`name`, `impl_cls`,
    `builder_cls`, `capabilities`) and implements `get_kv_cache_shape`; the `get_*` accessors
    read them (a backend may override them instead). The cache's block axis is read off
    `get_kv_cache_shape`. The default `swap_blocks` / `copy_blocks` move whole blocks along that
    axis; a backend whose layout needs more overrides them.
    """

    name: ClassVar[str]
    impl_cls: ClassVar[type[AttentionImpl[Any]]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder[Any]]]
    capabilities: ClassVar[BackendCapabilities]

    @classmethod
    def get_name(cls) -> str:
        return cls.name

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[Any]]:
        return cls.builder_cls

    @classmethod
    def get_kv_cache_block_dim(cls) -> int:
        """The axis of the KV-cache tensor that indexes blocks: the one axis of
        `get_kv_cache_shape` that follows `num_blocks` (probed with distinct sizes)."""
        shape = cls.get_kv_cache_shape(_PROBE_BLOCKS, 3, 5, 7)
        axes = [axis for axis, size in enumerate(shape) if size == _PROBE_BLOCKS]
        if len(axes) != 1:
            raise ValueError(
                f"{cls.__name__}.get_kv_cache_shape must have exactly one axis of num_blocks "
                f"(got {shape} for {_PROBE_BLOCKS} blocks); override get_kv_cache_block_dim "
                "and swap_blocks / copy_blocks for another layout"
            )
        return axes[0]

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    @classmethod
    def get_kv_cache_torch_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """The element type of the cache tensor for a `kv_cache_dtype` setting."""
        if kv_cache_dtype == "auto":
            return model_dtype
        if kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine at all (a missing package), or None."""
        return None

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Every reason this backend cannot serve `spec` here (empty when it can)."""
        missing = cls.unavailable_reason()
        return ([missing] if missing else []) + cls.capabilities.unsupported_reasons(spec)

    @classmethod
    def supports(cls, spec: AttentionSpec) -> bool:
        return not cls.unsupported_reasons(spec)

    @classmethod
    def swap_blocks(
        cls, src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, src_to_dst: torch.Tensor
    ) -> None:
        """Copy blocks src_to_dst[:, 0] of one cache into blocks src_to_dst[:, 1] of another,
        possibly on another device."""
        if src_to_dst.numel() == 0:
            return
        dim = cls.get_kv_cache_block_dim()
        src, dst = _bitwise(src_kv_cache), _bitwise(dst_kv_cache)
        src_idx = src_to_dst[:, 0].to(src.device)
        dst_idx = src_to_dst[:, 1].to(dst.device)
        dst.index_copy_(dim, dst_idx, src.index_select(dim, src_idx).to(dst.device))

    @classmethod
    def copy_blocks(cls, kv_caches: list[torch.Tensor], src_to_dsts: torch.Tensor) -> None:
        """Within each layer's cache, copy block src_to_dsts[i, 0] onto block src_to_dsts[i, 1]."""
        if src_to_dsts.numel() == 0:
            return
        dim = cls.get_kv_cache_block_dim()
        for cache in map(_bitwise, kv_caches):
            src_idx = src_to_dsts[:, 0].to(cache.device)
            dst_idx = src_to_dsts[:, 1].to(cache.device)
            cache.index_copy_(dim, dst_idx, cache.index_select(dim, src_idx))


_PROBE_BLOCKS = 1009  # a block count no other axis of a probed shape equals


def _bitwise(cache: torch.Tensor) -> torch.Tensor:
    """A view that block copies can index whatever the element type (fp8 lacks index ops)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache
