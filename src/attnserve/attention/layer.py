"""`Attention`: the module models use. It knows no backend.

Each layer describes what it needs as an `AttentionSpec` (its heads, head size, window, ALiBi,
soft-cap, cache dtype and block size; dtype and device from the defaults it is built under).
The model runner collects the model's specs (`attention_specs`), selects one backend for them
and binds it (`bind_attention_backend`), which checks that the backend serves each layer's spec
and builds that backend's operator; a layer built on its own may be handed a backend instead.
At forward time the layer passes the operator its bound KV cache and its spec's metadata from
the forward context (or, while a graph runner splits a capture at attention:
`splitting_at_attention`, hands its inputs to that split). A layer with an fp8 cache owns its
cache's scales (`KVCacheScales`, on the device it is built on), hands them to its operator, and
while they calibrate (`calibrating_kv_scales`) observes the keys and values it passes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionSpec,
)
from attnserve.attention.forward_context import get_attn_metadata
from attnserve.attention.kv_scales import KVCacheScales, calibrating
from attnserve.profiling import ATTENTION_RANGE, marked

# (the attention layer, its query, key, value) -> the layer's output
AttentionSplit = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        backend: type[AttentionBackend] | None = None,
    ) -> None:
        super().__init__()
        self.spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads or num_heads,
            head_size=head_size,
            dtype=torch.get_default_dtype(),
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            device=torch.get_default_device().type,
            sliding_window=sliding_window,
            use_alibi=alibi_slopes is not None,
            logits_soft_cap=logits_soft_cap,
        )
        self.scale = scale
        self.alibi_slopes = alibi_slopes
        self.backend: type[AttentionBackend] | None = None
        self.impl: AttentionImpl[AttentionMetadata] | None = None
        self.kv_cache = torch.empty(0)
        self.split: AttentionSplit | None = None  # set by `splitting_at_attention`
        self.kv_scales = (
            KVCacheScales(self.spec.num_kv_heads, torch.get_default_device())
            if kv_cache_dtype == "fp8"
            else None
        )
        if backend is not None:
            self.bind_backend(backend)

    def bind_backend(self, backend: type[AttentionBackend]) -> None:
        """Use `backend` for this layer: ValueError, with the reasons, if it cannot serve it."""
        reasons = backend.unsupported_reasons(self.spec)
        if reasons:
            raise ValueError(
                f"attention backend {backend.get_name()} cannot serve {self.spec}: "
                f"{'; '.join(reasons)}"
            )
        spec = self.spec
        self.backend = backend
        self.impl = backend.get_impl_cls()(
            num_heads=spec.num_heads,
            head_size=spec.head_size,
            scale=self.scale,
            num_kv_heads=spec.num_kv_heads,
            alibi_slopes=self.alibi_slopes,
            sliding_window=spec.sliding_window,
            logits_soft_cap=spec.logits_soft_cap,
            kv_cache_dtype=spec.kv_cache_dtype,
            kv_scales=self.kv_scales,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        if self.impl is None:
            raise RuntimeError("no attention backend bound to this layer (bind_attention_backend)")
        if self.kv_cache.numel() == 0:
            raise RuntimeError("no KV cache bound to this attention layer (bind_kv_caches)")
        if self.split is not None:
            return self.split(self, query, key, value)
        metadata = attn_metadata if attn_metadata is not None else get_attn_metadata(self.spec)
        if self.kv_scales is not None and self.kv_scales.calibrating:
            self.kv_scales.observe(key, value)
        with marked(ATTENTION_RANGE):
            return self.impl.forward(query, key, value, self.kv_cache, metadata)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, in module order (one KV cache each)."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def attention_specs(model: nn.Module) -> list[AttentionSpec]:
    """The distinct specs of the model's attention layers, in the order they first appear."""
    return list(dict.fromkeys(layer.spec for layer in attention_layers(model)))


@contextmanager
def splitting_at_attention(model: nn.Module, split: AttentionSplit) -> Iterator[None]:
    """Inside the block, each attention layer of `model` runs no operator: its call is
    `split(layer, query, key, value)` (a graph runner capturing the model piecewise)."""
    layers = attention_layers(model)
    for layer in layers:
        layer.split = split
    try:
        yield
    finally:
        for layer in layers:
            layer.split = None


def bind_attention_backend(model: nn.Module, backend: type[AttentionBackend]) -> None:
    """Bind `backend` to every attention layer of `model` (ValueError if it cannot serve one)."""
    for layer in attention_layers(model):
        layer.bind_backend(backend)


def calibrating_kv_scales(model: nn.Module) -> AbstractContextManager[None]:
    """Inside, every fp8-cache layer of `model` widens its scales to the keys and values it
    writes (`KVCacheScales.observe`); layers of other caches are untouched."""
    layers = attention_layers(model)
    return calibrating(layer.kv_scales for layer in layers if layer.kv_scales is not None)


def kv_scales_from_checkpoint(model: nn.Module) -> bool:
    """Whether every fp8-cache layer of `model` has the checkpoint's key and value scales (then
    none calibrates); ValueError when only some have them."""
    scales = [layer.kv_scales for layer in attention_layers(model) if layer.kv_scales is not None]
    if scales and all(s.from_checkpoint for s in scales):
        return True
    partial = [i for i, s in enumerate(scales) if s.partly_from_checkpoint]
    if partial:
        raise ValueError(
            f"the checkpoint has fp8 KV-cache scales (k_scale / v_scale) for attention layer "
            f"{partial[0]} but not for all of them (and both k and v): give every layer both, "
            "or none (then they are calibrated)"
        )
    return False


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give each attention layer of `model` its cache tensor, in module order."""
    layers = attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.kv_cache = cache
