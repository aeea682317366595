"""Our model's weights as an HF transformers model: the reference for parity tests and the
baseline of benchmarks, on exactly the weights attnserve runs (dummy, or as loaded: a quantized
layer's weight as its matmul sees it, dequantized)."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from attnserve.model.config import ModelConfig
from attnserve.model.layers.linear import MergedColumnParallelLinear
from attnserve.model.models.llama import STACKED_PARAMS
from attnserve.model.quantization import EmbeddingMethod, LinearMethod


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each layer's weight as its matmul sees it (dequantized when
    quantized) and the quantization's own tensors (FP8 scales) left out."""
    layers = {
        name: module
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(getattr(module, "quant_method", None), LinearMethod | EmbeddingMethod)
    }
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        layer = layers.get(module_name)
        if layer is not None and leaf == "weight":
            tensor = layer.quant_method.dense_weight(layer)
        elif layer is not None and leaf != "bias":
            continue
        state[name] = tensor
    return state


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under HF names, merged projections split back into their parts."""
    parts = {(merged, shard): part for merged, part, shard in STACKED_PARAMS}
    state = _dense_state(model)
    for module_name, module in model.named_modules():
        if not isinstance(module, MergedColumnParallelLinear):
            continue
        prefix, merged = module_name.rsplit(".", 1)
        for kind in ("weight", "bias"):
            tensor = state.pop(f"{module_name}.{kind}", None)
            if tensor is None:
                continue
            for shard, (start, size) in module.shards.items():
                state[f"{prefix}.{parts[(merged, shard)]}.{kind}"] = tensor.narrow(0, start, size)
    return state


def _device(model: nn.Module) -> torch.device:
    """Where the model's tensors live (a packed GGUF layer's `weight` is a shape on "meta")."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next(t.device for t in tensors if t.device.type != "meta")


def to_hf_model(model: nn.Module, config: ModelConfig, dtype: torch.dtype | None = None) -> Any:
    """The HF `AutoModelForCausalLM` of `config`, holding a copy of `model`'s weights."""
    from transformers import AutoModelForCausalLM

    device = _device(model)
    hf = AutoModelForCausalLM.from_config(config.hf_config, dtype=dtype or config.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [n for n in missing if not n.endswith("rotary_emb.inv_freq")]
    if config.hf_config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto HF: missing {missing}, unexpected {unexpected}")
    return hf.to(device).eval()
