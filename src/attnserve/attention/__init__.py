"""attnserve's attention layer: the backend contract, the registry, the selector and the module."""

from attnserve.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.forward_context import set_forward_context
from attnserve.attention.layer import Attention, attention_layers, bind_kv_caches
from attnserve.attention.registry import backend_names, get_backend_cls, register_backend
from attnserve.attention.selector import get_attn_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "BackendCapabilities",
    "attention_layers",
    "backend_names",
    "bind_kv_caches",
    "get_attn_backend",
    "get_backend_cls",
    "register_backend",
    "set_forward_context",
]
