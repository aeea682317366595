"""The Llama family on attnserve's layers: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model sees a flat batch of new tokens and their positions; each decoder layer's `Attention`
reads the step's metadata from the forward context and its bound KV cache, so the model knows
no backend. q/k/v and gate/up run as one merged matmul each; `load_weights` maps HF checkpoint
names onto the merged parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.attention import Attention, AttentionBackend
from attnserve.model.config import ModelConfig, layer_sliding_windows, rope_settings
from attnserve.model.layers.activation import SiluAndMul
from attnserve.model.layers.embedding import VocabEmbedding
from attnserve.model.layers.layernorm import RMSNorm
from attnserve.model.layers.linear import Linear, MergedLinear
from attnserve.model.layers.rotary_embedding import RotaryEmbedding

# (merged parameter, HF projection, shard name)
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedLinear(hidden_size, sizes, ["gate", "up"], bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        attn_backend: type[AttentionBackend],
        kv_cache_dtype: str,
        variant: type[LlamaForCausalLM],
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_size = config.head_size
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = bool(getattr(hf, "attention_bias", False))
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            ["q", "k", "v"],
            bias or variant.qkv_bias,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias)
        self.q_norm = self.k_norm = None
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_size, hf.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, hf.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_size,
            self.head_size**-0.5,
            self.num_kv_heads,
            sliding_window=layer_sliding_windows(hf)[layer_index],
            kv_cache_dtype=kv_cache_dtype,
            backend=attn_backend,
        )

    def _head_norm(self, norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        if norm is None:
            return x
        return norm(x.reshape(x.shape[0], -1, self.head_size)).flatten(1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        attn_backend: type[AttentionBackend],
        kv_cache_dtype: str,
        variant: type[LlamaForCausalLM],
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = LlamaAttention(
            config, layer_index, attn_backend, kv_cache_dtype, variant, rotary_emb
        )
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: type[AttentionBackend],
        kv_cache_dtype: str,
        variant: type[LlamaForCausalLM],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        theta, scaling = rope_settings(config.hf_config)
        rotary_emb = RotaryEmbedding(config.head_size, config.max_model_len, theta, scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attn_backend, kv_cache_dtype, variant, rotary_emb)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
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
        self,
        config: ModelConfig,
        attn_backend: type[AttentionBackend],
        kv_cache_dtype: str = "auto",
    ) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend, kv_cache_dtype, type(self))
        self.tie_word_embeddings = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        self.lm_head = (
            self.model.embed_tokens
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in float32."""
        return F.linear(hidden, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; ValueError on unknown or missing ones."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            loaded.add(self._load_one(params, name, tensor))
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:5]}")

    def _load_one(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        for merged, part, shard in STACKED_PARAMS:
            if f".{part}." in name:
                target = name.replace(f".{part}.", f".{merged}.")
                layer: Any = self.get_submodule(target.rsplit(".", 1)[0])
                layer.load_shard(self._param(params, target), shard, tensor)
                return target
        param = self._param(params, name)
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
            )
        if tensor.dtype == param.dtype and tensor.device == param.device:
            param.data = tensor  # no copy (a memory-mapped checkpoint stays mapped)
        else:
            param.data.copy_(tensor)
        return name

    @staticmethod
    def _param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no parameter in this model")
        return params[name]


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding attention window (from the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
