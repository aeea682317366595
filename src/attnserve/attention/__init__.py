"""attnserve's attention layer: the backend contract, the registry, the selector and the module."""

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    BackendCapabilities,
)
from attnserve.attention.forward_context import (
    Builders,
    StepMetadata,
    build_metadata,
    metadata_builders,
    set_forward_context,
)
from attnserve.attention.kv_scales import KVCacheScales
from attnserve.attention.layer import (
    Attention,
    AttentionSplit,
    attention_layers,
    attention_specs,
    bind_attention_backend,
    bind_kv_caches,
    calibrating_kv_scales,
    kv_scales_from_checkpoint,
    splitting_at_attention,
)
from attnserve.attention.layout import (
    StepLayout,
    as_decode_rows,
    build_step_layout,
    layout_from_arrays,
)
from attnserve.attention.registry import backend_names, get_backend_cls, register_backend
from attnserve.attention.selector import get_attn_backend, get_model_attn_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionSplit",
    "BackendCapabilities",
    "Builders",
    "KVCacheScales",
    "StepLayout",
    "StepMetadata",
    "as_decode_rows",
    "attention_layers",
    "attention_specs",
    "backend_names",
    "bind_attention_backend",
    "bind_kv_caches",
    "build_metadata",
    "build_step_layout",
    "calibrating_kv_scales",
    "get_attn_backend",
    "get_backend_cls",
    "get_model_attn_backend",
    "kv_scales_from_checkpoint",
    "layout_from_arrays",
    "metadata_builders",
    "register_backend",
    "set_forward_context",
    "splitting_at_attention",
]
