"""The one registry of attention backends, by name.

Built-in backends are listed here as import paths (loaded on first use, so a backend whose
package is missing costs nothing until asked for). Third-party backends register with
`register_backend`, or with no code change through the entry-point group
`attnserve.attention_backends` (entry-point name = backend name, value = "module:Class").
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from attnserve.attention.abstract import AttentionBackend

ENTRY_POINT_GROUP = "attnserve.attention_backends"

_registry: dict[str, type[AttentionBackend] | str] = {
    "TORCH_SDPA": "attnserve.attention.backends.torch_sdpa:TorchSDPABackend",
    "CPU_NATIVE": "attnserve.attention.backends.cpu_native:CpuNativeBackend",
    "TRITON": "attnserve.attention.backends.triton:TritonBackend",
    "FLASHINFER": "attnserve.attention.backends.flashinfer:FlashInferBackend",
    "FLEX_ATTENTION": "attnserve.attention.backends.flex:FlexAttentionBackend",
    "FLASH_ATTN": "attnserve.attention.backends.flash_attn:FlashAttnBackend",
}
_entry_points_loaded = False


def register_backend(name: str, backend: type[AttentionBackend] | str) -> None:
    """Register a backend class, or a lazy "module:Class" path, under an upper-case name."""
    if not name or name != name.upper():
        raise ValueError(f"backend names are non-empty and upper-case, got {name!r}")
    _registry[name] = backend if isinstance(backend, str) else _checked(backend, name)


def _checked(backend: object, where: str) -> type[AttentionBackend]:
    """`backend`, once it is known to be an AttentionBackend whose KV-cache shape has one
    block axis (ValueError otherwise)."""
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise ValueError(f"{where} is not an AttentionBackend subclass")
    backend.get_kv_cache_block_dim()
    return backend


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        _registry.setdefault(point.name.upper(), point.value)


def backend_names() -> list[str]:
    """Every registered backend name, built-in first, in registration order."""
    _load_entry_points()
    return list(_registry)


def get_backend_cls(name: str) -> type[AttentionBackend]:
    """The backend class registered under `name`; ValueError for an unknown name, ImportError
    when its module cannot be imported here."""
    _load_entry_points()
    if name not in _registry:
        raise ValueError(f"unknown attention backend {name!r}; registered: {backend_names()}")
    target = _registry[name]
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        loaded = getattr(importlib.import_module(module_name), attr)
        _registry[name] = target = _checked(loaded, target)
    return target
