"""Gemma 2 and Gemma 3 (text) on the Llama family's layers, done as HF transformers does them.

What differs from Llama: token embeddings scaled by sqrt(hidden_size) (the factor rounded to the
model dtype), RMSNorms scaling by (1 + weight) in float32, a GeGLU feed-forward (tanh-approximated
GELU), a norm after attention and around the feed-forward block (pre- and post-), attention
scaled by `query_pre_attn_scalar`**-0.5, tied embeddings, and a per-layer sliding window
(`layer_types`). Gemma 2 soft-caps attention logits and final logits; Gemma 3 instead normalises
q and k per head and gives its sliding layers their own rotary base; a multimodal Gemma 3
checkpoint loads as its text model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from attnserve.model.config import ModelConfig
from attnserve.model.layers.activation import GeluTanhAndMul
from attnserve.model.layers.layernorm import GemmaRMSNorm, RMSNorm
from attnserve.model.layers.linear import fuse_input_quantization
from attnserve.model.models.llama import (
    LayerParts,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from attnserve.model.quantization.weight_utils import LoadedWeight


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer plus norms on the attention output and around the feed-forward block:
    h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, parts: LayerParts, layer_index: int) -> None:
        super().__init__(parts, layer_index)
        size, eps = parts.config.hidden_size, parts.config.hf_config.rms_norm_eps
        self.pre_feedforward_layernorm = parts.variant.make_norm(size, eps)
        self.post_feedforward_layernorm = parts.variant.make_norm(size, eps)
        self.post_attention_layernorm.output_fp8 = False  # it norms the attention output here
        if isinstance(self.mlp, LlamaMLP):
            fuse_input_quantization(self.pre_feedforward_layernorm, self.mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.attend(positions, hidden, residual)
        hidden = self.post_attention_layernorm(hidden)
        normed, residual = self.pre_feedforward_layernorm.forward_to_linear(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: alternating sliding-window and global layers, soft-capped attention and final
    logits."""

    @classmethod
    def make_decoder_layer(cls, parts: LayerParts, layer_index: int) -> nn.Module:
        return GemmaDecoderLayer(parts, layer_index)

    @classmethod
    def make_norm(cls, hidden_size: int, eps: float) -> RMSNorm:
        return GemmaRMSNorm(hidden_size, eps)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_index: int) -> nn.Module:
        hf = config.hf_config
        activation = getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma hidden_activation {activation!r}")
        return LlamaMLP(config.hidden_size, int(hf.intermediate_size), False, GeluTanhAndMul())

    @classmethod
    def attention_scale(cls, config: ModelConfig) -> float:
        return float(config.hf_config.query_pre_attn_scalar) ** -0.5

    @classmethod
    def attention_soft_cap(cls, hf_config: Any) -> float | None:
        cap = getattr(hf_config, "attn_logit_softcapping", None)
        return None if cap is None else float(cap)

    @classmethod
    def embedding_scale(cls, config: ModelConfig) -> float | None:
        # HF multiplies by a tensor of sqrt(hidden_size) cast to the embedding's dtype
        return float(torch.tensor(config.hidden_size**0.5, device="cpu").to(config.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits soft-capped by `final_logit_softcapping` in the model dtype (as HF does),
        returned in float32."""
        logits = self.lm_head.compute_logits(hidden)
        cap = getattr(self.config.hf_config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): q/k head norms, five sliding layers per global one, the sliding layers'
    own rotary base (10k; global 1M, linearly scaled), no soft-caps (absent from its config)."""

    qk_norm = True

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Also a multimodal checkpoint's text model (`language_model.model.*`, or
        `model.language_model.*`), its vision tower and projector left out."""
        super().load_weights(
            (_TEXT_PREFIXES.get(prefix, "") + rest, weight)
            for name, weight in weights
            for prefix, rest in [_split_prefix(name)]
            if prefix not in _VISION_PREFIXES
        )


# checkpoint prefix of a multimodal Gemma 3's text weights -> this model's
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _split_prefix(name: str) -> tuple[str, str]:
    """(the name's multimodal prefix, or "" for a text model's name; the rest)."""
    for prefix in (*_TEXT_PREFIXES, *_VISION_PREFIXES):
        if name.startswith(prefix):
            return prefix, name.removeprefix(prefix)
    return "", name
