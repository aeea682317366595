"""Tiny random MoE checkpoints for tests: HF transformers' own Qwen3-MoE and Mixtral, saved with
`save_pretrained` (per-expert names, as on the hub). Every weight is random (norms around 1), large
enough that routing and greedy tokens depend on all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

TINY_MOE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 192,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 191,
    "bos_token_id": 1,
    "tie_word_embeddings": False,
}
QWEN3_MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 48,
    "head_dim": 32,
}
# case -> (config class, overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-moe-norm-topk": ("Qwen3MoeConfig", {**QWEN3_MOE, "norm_topk_prob": True}),
    "qwen3-moe-dense-first": (
        "Qwen3MoeConfig",
        {**QWEN3_MOE, "norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
    "qwen3-moe-sparse-step": (
        "Qwen3MoeConfig",
        {**QWEN3_MOE, "norm_topk_prob": True, "decoder_sparse_step": 2},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def tiny_moe_model(case: str, **changes: Any) -> Any:
    """HF's model of `case` (config `changes` applied) in float32 with seeded random weights."""
    config_cls, overrides = CASES[case]
    config = getattr(transformers, config_cls)(**{**TINY_MOE, **overrides, **changes})
    config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + 0.15 * torch.randn_like(param))
    return model.eval()


def save_tiny_moe(path: Path, case: str) -> Any:
    """Save `case` with `save_pretrained` under `path`; return HF's model."""
    model = tiny_moe_model(case)
    model.save_pretrained(path)
    return model
