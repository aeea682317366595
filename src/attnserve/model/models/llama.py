"""The Llama family on attnserve's layers: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model sees a flat batch of new tokens and their positions; each decoder layer's `Attention`
reads the step's metadata from the forward context and its bound KV cache, so the model knows
no backend. q/k/v and gate/up run as one merged matmul each; `load_weights` maps HF checkpoint
names onto the merged parameters. Under tensor parallelism the layers are sharded (vLLM's
column/row-parallel scheme) and each parameter's weight loader keeps only its rank's shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from attnserve.attention import Attention
from attnserve.model.config import (
    LAYER_KINDS,
    ModelConfig,
    layer_sliding_windows,
    rope_settings,
)
from attnserve.model.layers.activation import GatedActivation, SiluAndMul
from attnserve.model.layers.layernorm import RMSNorm
from attnserve.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    fuse_input_quantization,
)
from attnserve.model.layers.rotary_embedding import RotaryEmbedding
from attnserve.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from attnserve.model.quantization.fp8_format import LinearInput
from attnserve.model.quantization.weight_utils import LoadedWeight, full_weight, load_weight

logger = logging.getLogger(__name__)

# (merged parameter, HF projection, shard name)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# fp8 KV-cache scales by checkpoint name: 0 keys, 1 values
KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": 0,
    ".self_attn.v_scale": 1,
    ".self_attn.k_proj.output_scale": 0,
    ".self_attn.v_proj.output_scale": 1,
}


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        act_fn: GatedActivation | None = None,
    ) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, sizes, ["gate", "up"], bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = act_fn if act_fn is not None else SiluAndMul()
        fuse_input_quantization(self.act_fn, self.down_proj)

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self.down_proj(self.act_fn.forward_to_linear(self.gate_up_proj(x)))


@dataclass(frozen=True)
class LayerParts:
    """What every decoder layer of one model is built from (the rotary table is shared)."""

    config: ModelConfig
    kv_cache_dtype: str
    block_size: int
    variant: type[LlamaForCausalLM]
    rotary_emb: RotaryEmbedding
    local_rotary_emb: RotaryEmbedding  # sliding-window layers' table (Gemma 3's own base)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        parts: LayerParts,
        layer_index: int,
    ) -> None:
        super().__init__()
        config, hf = parts.config, parts.config.hf_config
        self.head_size = config.head_size
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_size,
            config.num_heads,
            config.num_kv_heads,
            bias or parts.variant.qkv_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(config.num_heads * self.head_size, config.hidden_size, bias)
        self.q_norm = self.k_norm = None
        self.head_norms: tuple[RMSNorm, RMSNorm] | None = None
        if parts.variant.qk_norm:
            self.q_norm = parts.variant.make_norm(self.head_size, hf.rms_norm_eps)
            self.k_norm = parts.variant.make_norm(self.head_size, hf.rms_norm_eps)
            self.head_norms = (self.q_norm, self.k_norm)
        window = layer_sliding_windows(hf)[layer_index]
        self.rotary_emb = parts.rotary_emb if window is None else parts.local_rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            parts.variant.attention_scale(config),
            self.num_kv_heads,
            sliding_window=window,
            logits_soft_cap=parts.variant.attention_soft_cap(hf),
            kv_cache_dtype=parts.kv_cache_dtype,
            block_size=parts.block_size,
        )

    def load_kv_scale(self, index: int, weight: LoadedWeight) -> bool:
        """A checkpoint's fp8 KV-cache key (`index` 0) or value (1) scale for this rank's KV
        heads; False (unused) where the cache is not fp8."""
        scales = self.attn.kv_scales
        if scales is None:
            return False
        scales.load(index, full_weight(weight), self.qkv_proj.kv_head_start)
        return True

    def forward(self, positions: torch.Tensor, hidden: LinearInput) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k, v = self.rotary_emb.forward_qkv(positions, (q, k, v), self.head_norms)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        parts: LayerParts,
        layer_index: int,
    ) -> None:
        super().__init__()
        config, hf = parts.config, parts.config.hf_config
        self.self_attn = LlamaAttention(parts, layer_index)
        self.mlp = parts.variant.make_mlp(config, layer_index)
        self.input_layernorm = parts.variant.make_norm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = parts.variant.make_norm(config.hidden_size, hf.rms_norm_eps)
        fuse_input_quantization(self.input_layernorm, self.self_attn.qkv_proj)
        if isinstance(self.mlp, LlamaMLP):
            fuse_input_quantization(self.post_attention_layernorm, self.mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.attend(positions, hidden, residual)
        normed, residual = self.post_attention_layernorm.forward_to_linear(hidden, residual)
        return self.mlp(normed), residual

    def attend(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention output, residual stream): `residual` (if any) added to `hidden`, the sum
        normalised and attended over."""
        normed, residual = self.input_layernorm.forward_to_linear(hidden, residual)
        return self.self_attn(positions, normed), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        kv_cache_dtype: str,
        block_size: int,
        variant: type[LlamaForCausalLM],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = variant.embedding_scale(config)
        rotary_embs = variant.make_rotary_embs(config)
        parts = LayerParts(config, kv_cache_dtype, block_size, variant, *rotary_embs)
        self.layers = nn.ModuleList(
            variant.make_decoder_layer(parts, i) for i in range(config.num_layers)
        )
        self.norm = variant.make_norm(config.hidden_size, config.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:
            return self.norm(hidden)
        return self.norm.forward_with_residual(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[bool] = False

    def __init__(
        self, config: ModelConfig, kv_cache_dtype: str = "auto", block_size: int = 16
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, kv_cache_dtype, block_size, type(self))
        self.tie_word_embeddings = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens
            if self.tie_word_embeddings
            else ParallelLMHead(config.vocab_size, config.hidden_size)
        )

    @classmethod
    def make_decoder_layer(cls, parts: LayerParts, layer_index: int) -> nn.Module:
        """Decoder layer `layer_index`: forward(positions, hidden, residual | None) ->
        (hidden, residual)."""
        return LlamaDecoderLayer(parts, layer_index)

    @classmethod
    def make_norm(cls, hidden_size: int, eps: float) -> RMSNorm:
        """The model's RMSNorm (every layer norm, the final norm and any q/k norms)."""
        return RMSNorm(hidden_size, eps)

    @classmethod
    def make_rotary_embs(cls, config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """The rotary tables of (full-attention layers, sliding-window layers): one shared
        unless the config gives sliding layers their own settings (Gemma 3)."""
        full, sliding = (rope_settings(config.hf_config, kind) for kind in LAYER_KINDS)
        size, max_len = config.head_size, config.max_model_len
        rotary_emb = RotaryEmbedding(size, max_len, *full)
        return rotary_emb, rotary_emb if sliding == full else RotaryEmbedding(
            size, max_len, *sliding
        )

    @classmethod
    def attention_scale(cls, config: ModelConfig) -> float:
        """The factor on q.k before the softmax."""
        return float(config.head_size**-0.5)

    @classmethod
    def attention_soft_cap(cls, hf_config: Any) -> float | None:
        """The attention logits' soft-cap (None: none)."""
        return None

    @classmethod
    def embedding_scale(cls, config: ModelConfig) -> float | None:
        """The factor on the token embeddings (None: none)."""
        return None

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_index: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer_index` (a gated MLP here)."""
        hf = config.hf_config
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        return LlamaMLP(config.hidden_size, int(hf.intermediate_size), mlp_bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        """Copy HF-named weights (each rank its shard) into the parameters; ValueError on unknown
        or missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unused_kv_scales = 0
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            kv_scale = _kv_scale_of(name)
            if kv_scale is not None:
                attention, index = kv_scale
                unused_kv_scales += not self._attention(attention).load_kv_scale(index, tensor)
                continue
            loaded.add(self._load_one(params, name, tensor))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")
        if unused_kv_scales:
            logger.info("the checkpoint's fp8 KV-cache scales are unused: the KV cache is not fp8")

    def _attention(self, name: str) -> LlamaAttention:
        try:
            module = self.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, LlamaAttention):
            raise ValueError(f"checkpoint KV-cache scale of {name!r}: no such attention layer")
        return module

    def _load_one(self, params: dict[str, nn.Parameter], name: str, weight: LoadedWeight) -> str:
        for merged, part, shard in STACKED_PARAMS:
            if f".{part}." in name:
                target = name.replace(f".{part}.", f".{merged}.")
                load_weight(self._param(params, target), weight, target, shard)
                return target
        load_weight(self._param(params, name), weight, name)
        return name

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no parameter in this model")
        return params[name]


def _kv_scale_of(name: str) -> tuple[str, int] | None:
    """(the attention module, 0 for keys or 1 for values) of an fp8 KV-cache scale's
    checkpoint name (vLLM's `self_attn.k_scale`, llm-compressor's `self_attn.k_proj.output_scale`),
    or None for any other weight."""
    for suffix, index in KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".self_attn", index
    return None


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
