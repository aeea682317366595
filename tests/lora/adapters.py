"""PEFT adapters written by hand: `adapter_config.json` and `adapter_model.safetensors` in PEFT's
layout and names, random weights, any config options (the malformed and unsupported adapters of
test_peft.py among them); and the reference model with an adapter merged into its weights
(W + scaling · B A), saved as an HF checkpoint. Without a model to wrap they are quick for the
many tests that need adapters; test_peft_reference.py checks the engine against peft itself."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a Llama config dict."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head = config.get("head_dim") or hidden // heads
    q, kv = heads * head, config["num_key_value_heads"] * head
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip


def peft_name(layer: int, module: str, half: str) -> str:
    parent = _PARENT.get(module, "self_attn")
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{half}.weight"


def write_peft_adapter(
    folder: Path,
    config: dict[str, Any],
    rank: int = 8,
    alpha: float = 16.0,
    modules: Sequence[str] = ALL_MODULES,
    seed: int = 0,
    **options: Any,
) -> Path:
    """A random adapter of `config`'s model in PEFT's layout; `options` go into the config
    (e.g. use_rslora=True, use_dora=True)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            fan_in, fan_out = shapes[module]
            tensors[peft_name(layer, module, "A")] = torch.randn(rank, fan_in, generator=gen) * 0.3
            tensors[peft_name(layer, module, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
        "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
    }  # fmt: skip
    adapter_config.update(options)
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return folder


def write_merged_model(base: Path, adapter: Path, target: Path) -> Path:
    """`base` (an HF Llama directory) with `adapter` merged into its weights."""
    shutil.copytree(base, target)
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    rank, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for name in list(weights):
        a_name = "base_model.model." + name.replace(".weight", ".lora_A.weight")
        if a_name in lora:
            b = lora[a_name.replace("lora_A", "lora_B")].double()
            delta = scaling * b @ lora[a_name].double()
            weights[name] = (weights[name].double() + delta).to(weights[name].dtype)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
