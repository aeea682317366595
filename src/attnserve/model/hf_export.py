"""Our model's weights as an HF transformers model: the reference for parity tests and the
baseline of benchmarks, on exactly the weights attnserve runs (GGUF-dequantized or dummy)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.model.config import ModelConfig
from attnserve.model.layers.linear import MergedColumnParallelLinear
from attnserve.model.models.llama import STACKED_PARAMS


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under HF names, merged projections split back into their parts."""
    parts = {(merged, shard): part for merged, part, shard in STACKED_PARAMS}
    state: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, MergedColumnParallelLinear):
            prefix, merged = module_name.rsplit(".", 1)
            for shard, (start, size) in module.shards.items():
                for kind in ("weight", "bias"):
                    tensor = getattr(module, kind)
                    if tensor is not None:
                        name = f"{prefix}.{parts[(merged, shard)]}.{kind}"
                        state[name] = tensor.narrow(0, start, size)
    merged_names = {
        f"{n}.{k}"
        for n, m in model.named_modules()
        if isinstance(m, MergedColumnParallelLinear)
        for k in ("weight", "bias")
    }
    for name, tensor in model.state_dict().items():
        if name not in merged_names:
            state[name] = tensor
    return state


def to_hf_model(model: nn.Module, config: ModelConfig, dtype: torch.dtype | None = None) -> Any:
    """The HF `AutoModelForCausalLM` of `config`, holding a copy of `model`'s weights."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    hf = AutoModelForCausalLM.from_config(config.hf_config, dtype=dtype or config.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [n for n in missing if not n.endswith("rotary_emb.inv_freq")]
    if config.hf_config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"weights do not map onto HF: missing {missing}, unexpected {unexpected}")
    return hf.to(device).eval()
