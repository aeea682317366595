"""`Attention`: the module models use. It knows no backend.

It asks the selector for a backend (unless the model runner hands one in), builds that backend's
operator, and at forward time passes the operator its bound KV cache and the step's metadata from
the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.attention.backends.abstract import AttentionBackend, AttentionMetadata
from attnserve.attention.forward_context import get_attn_metadata
from attnserve.attention.selector import get_attn_backend
from attnserve.profiling import ATTENTION_RANGE


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
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.backend = backend or get_attn_backend(
            head_size,
            torch.get_default_dtype(),
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            use_alibi=alibi_slopes is not None,
            logits_soft_cap=logits_soft_cap,
        )
        self.impl = self.backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            self.num_kv_heads,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.kv_cache = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        if self.kv_cache.numel() == 0:
            raise RuntimeError("no KV cache bound to this attention layer (bind_kv_caches)")
        metadata = attn_metadata if attn_metadata is not None else get_attn_metadata()
        with torch.profiler.record_function(ATTENTION_RANGE):
            return self.impl.forward(query, key, value, self.kv_cache, metadata)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, in module order (one KV cache each)."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give each attention layer of `model` its cache tensor, in module order."""
    layers = attention_layers(model)
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} attention layers")
    for layer, cache in zip(layers, kv_caches, strict=True):
        layer.kv_cache = cache
