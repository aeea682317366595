"""`load_model`: build the registered model for a `ModelConfig` on a device and fill its weights.

The model is built directly on the target device in the config's dtype (parameters start
uninitialised), then filled from safetensors, a GGUF file, or seeded random values (dummy).
Under tensor parallelism each rank builds its shard of the model and keeps only its part of
each weight: safetensors slices are read lazily (only the rank's rows or columns), a GGUF
tensor is read whole and then sliced. The model is built under its quantization (its layers'
methods, `model.quantization`), which finishes each layer's weights once all are loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from attnserve.distributed import get_tensor_model_parallel_world_size
from attnserve.model.config import ModelConfig
from attnserve.model.quantization import active_quantization, process_weights_after_loading
from attnserve.model.quantization.resolve import quantization_config
from attnserve.model.registry import get_model_cls_name
from attnserve.model.weights import init_dummy_weights, iter_safetensors

if TYPE_CHECKING:
    from attnserve.model.models.llama import LlamaForCausalLM


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model_cls(architecture: str) -> type[LlamaForCausalLM]:
    """The model class for an HF architecture name (ValueError for an unregistered one)."""
    module_name, cls_name = get_model_cls_name(architecture)
    model_cls: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), cls_name)
    return model_cls


def build_model(
    config: ModelConfig,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
) -> LlamaForCausalLM:
    """The model with uninitialised weights on `device` (use "meta" to inspect shapes); its
    attention layers have no backend until one is bound (`bind_attention_backend`)."""
    model_cls = get_model_cls(config.architecture)
    weights = None if config.load_format == "dummy" else config.weights_path or config.model
    quantization = quantization_config(config.quantization, config.hf_config, weights)
    with _default_dtype(config.dtype), torch.device(device), active_quantization(quantization):
        return model_cls(config, kv_cache_dtype, block_size)


@torch.no_grad()
def load_model(
    config: ModelConfig,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
) -> LlamaForCausalLM:
    """The model in eval mode, on `device`, in `config.dtype`, with its weights loaded."""
    model = build_model(config, device, kv_cache_dtype, block_size)
    path = config.weights_path or config.model
    packed = config.quantization == "gguf"
    if config.load_format == "dummy":
        init_dummy_weights(model)
    elif config.load_format == "gguf":
        from attnserve.model.gguf import iter_gguf_weights

        model.load_weights(iter_gguf_weights(path, config.hf_config, keep_packed=packed))
    else:
        lazy = get_tensor_model_parallel_world_size() > 1  # each rank reads only its shards
        model.load_weights(iter_safetensors(path, lazy, keep_packed=packed))
    process_weights_after_loading(model)
    return model.eval()


__all__ = ["build_model", "get_model_cls", "load_model"]
