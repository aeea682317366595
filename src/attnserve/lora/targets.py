"""Which projections of a model an adapter may target, and their full (unsharded) shapes.

LoRA covers the seven projections of every decoder layer of the dense Llama family (Llama,
Mistral, Qwen2/3, Gemma 2/3): q/k/v/o of the attention and gate/up/down of the MLP. Shapes come
from the model config alone, so the front end checks an adapter before a rank ever sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.model.config import ModelConfig, num_experts

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES
# merged layers of the model: the layer's attribute path and the projections stacked in it
MERGED_LAYERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn.o_proj", ("o_proj",)),
    "gate_up_proj": ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    "down_proj": ("mlp.down_proj", ("down_proj",)),
}


@dataclass(frozen=True)
class LoRATargets:
    """A model's LoRA-able projections: `shapes[module]` = (in_features, out_features) of the
    full weight, the same in each of `num_layers` layers."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of_model(cls, config: ModelConfig) -> LoRATargets:
        """The targets of `config`'s model; ValueError for a model LoRA does not serve."""
        if num_experts(config.hf_config) > 0:
            raise ValueError(
                f"LoRA is not supported for mixture-of-experts models ({config.architecture})"
            )
        if config.quantization is not None:
            raise ValueError(f"LoRA is not supported with quantization {config.quantization!r}")
        hidden, head = config.hidden_size, config.head_size
        q_size, kv_size = config.num_heads * head, config.num_kv_heads * head
        inter = int(config.hf_config.intermediate_size)
        shapes = {
            "q_proj": (hidden, q_size),
            "k_proj": (hidden, kv_size),
            "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(config.num_layers, shapes)
