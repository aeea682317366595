"""Mixture-of-experts members of the Llama family: Qwen3-MoE and Mixtral.

Attention is Llama's (Qwen3-MoE with Qwen3's q/k norms); the feed-forward block of a sparse
layer is the shared `SparseMoeBlock` (router `mlp.gate`, experts `mlp.experts` with stacked
`gate_up_proj` / `down_proj`), and Qwen3-MoE's dense layers (`mlp_only_layers`,
`decoder_sparse_step`: `config.sparse_layers`) keep Llama's MLP. Checkpoints name the experts
one by one (`mlp.experts.N.gate_proj`, Mixtral's `block_sparse_moe.experts.N.w1`: what
`save_pretrained` writes and the hub's files hold); HF's in-memory stacked names
(`mlp.experts.gate_up_proj`) are this model's own and load whole.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from torch import nn

from attnserve.model.config import ModelConfig, num_experts, sparse_layers
from attnserve.model.layers.moe import DOWN_SHARD, MoESpec, SparseMoeBlock
from attnserve.model.models.llama import LlamaForCausalLM
from attnserve.model.quantization.weight_utils import LoadedWeight

_EXPERT = re.compile(r"(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose sparse layers route each token to `top_k` experts."""

    # checkpoint name of each expert projection -> the stacked weight's shard
    expert_projections: ClassVar[dict[str, str]] = {
        "gate_proj": "gate",
        "up_proj": "up",
        "down_proj": DOWN_SHARD,
    }
    checkpoint_moe_block: ClassVar[str] = "mlp"  # the MoE block's name in checkpoints

    # how each model's HF config describes its experts
    intermediate_size_field: ClassVar[str] = "moe_intermediate_size"
    weights_in_model_dtype: ClassVar[bool] = True  # routing weights rounded to the model dtype

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        """Whether the top-k routing weights are renormalised to sum to one."""
        return True

    @classmethod
    def moe_spec(cls, hf_config: Any) -> MoESpec:
        """The sparse layers' router and experts, from the HF config."""
        return MoESpec(
            num_experts=num_experts(hf_config),
            top_k=int(hf_config.num_experts_per_tok),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(getattr(hf_config, cls.intermediate_size_field)),
            renormalize=cls.renormalize(hf_config),
            weights_in_model_dtype=cls.weights_in_model_dtype,
        )

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_index: int) -> nn.Module:
        if not sparse_layers(config.hf_config)[layer_index]:
            return super().make_mlp(config, layer_index)
        return SparseMoeBlock(cls.moe_spec(config.hf_config))

    def _load_one(self, params: dict[str, nn.Parameter], name: str, weight: LoadedWeight) -> str:
        name = name.replace(f".{self.checkpoint_moe_block}.", ".mlp.")
        match = _EXPERT.fullmatch(name)
        if match is None:
            return super()._load_one(params, name, weight)
        shard = self.expert_projections.get(match["proj"])
        if shard is None:
            raise ValueError(f"checkpoint weight {name!r} has no parameter in this model")
        stacked = "down_proj" if shard == DOWN_SHARD else "gate_up_proj"
        target = f"{match['experts']}.{stacked}"
        param = self._param(params, target)
        param.weight_loader(param, weight, shard, int(match["expert"]))  # type: ignore[attr-defined]
        return target


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        return bool(hf_config.norm_topk_prob)


class MixtralForCausalLM(MoeForCausalLM):
    """Top-k (2) of 8 experts, always renormalised; a sliding window when the config has one."""

    expert_projections: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": DOWN_SHARD}
    checkpoint_moe_block: ClassVar[str] = "block_sparse_moe"
    intermediate_size_field: ClassVar[str] = "intermediate_size"
    weights_in_model_dtype: ClassVar[bool] = False
