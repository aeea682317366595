"""The sparse mixture-of-experts block the MoE models share: a router and a set of gated-MLP
experts (vLLM's `FusedMoE`).

Routing follows HF transformers: router logits in the model dtype, softmax in float32, top-k,
optionally renormalised to sum to 1 (`MoESpec.renormalize`); Qwen3-MoE then rounds the weights
to the model dtype (`weights_in_model_dtype`), Mixtral keeps them in float32. The experts' weights
are stacked: `gate_up_proj` [E, 2·I, H] (each expert's gate rows, then its up rows) and
`down_proj` [E, H, I], HF's own layout. Routing and experts are `ops.moe_topk` and
`ops.moe_experts`: on CUDA (with Triton) the fused-MoE kernels (`fused_moe_routing`,
`fused_moe`); elsewhere, and as their reference, plain torch, expert by expert in HF's order.

Tensor parallelism shards every expert's intermediate dimension: each rank keeps rows
[r·I/tp, (r+1)·I/tp) of each expert's gate and up (column-parallel) and the same columns of its
down (row-parallel), and the ranks' partial outputs are summed by one all-reduce after the top-k
sum. The router is replicated, so every rank routes each token alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnserve.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from attnserve.model.layers import ops
from attnserve.model.layers.linear import Linear
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    copy_checked,
    full_weight,
    narrow_weight,
    set_weight_attrs,
    weight_shape,
)

GATE_UP_SHARDS = ("gate", "up")
DOWN_SHARD = "down"


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per expert, over all ranks
    renormalize: bool
    weights_in_model_dtype: bool

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in 1..{self.num_experts} (the experts)"
            )


class FusedMoE(nn.Module):
    """The experts of one MoE layer: routed tokens in, the weighted sum of their experts' outputs
    out (all-reduced over the tensor-parallel ranks)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.local_size = divide(intermediate_size, get_tensor_model_parallel_world_size())
        local, full = self.local_size, intermediate_size
        gate_up = torch.empty(num_experts, 2 * local, hidden_size)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        down = torch.empty(num_experts, hidden_size, local)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        set_weight_attrs(
            self.gate_up_proj, self.weight_loader, (num_experts, 2 * full, hidden_size)
        )
        set_weight_attrs(self.down_proj, self.weight_loader, (num_experts, hidden_size, full))

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: LoadedWeight,
        shard_id: str | None = None,
        expert_id: int | None = None,
    ) -> None:
        """Copy this rank's share of a full checkpoint weight: all experts stacked (`expert_id`
        None) or one expert's; for `gate_up_proj` both projections (`shard_id` None) or one
        ("gate", "up"); for `down_proj` shard_id None or "down"."""
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range: this layer has {self.num_experts}")
        target = param.data if expert_id is None else param.data[expert_id]
        full, local = self.intermediate_size, self.local_size
        if param is self.down_proj:
            if shard_id not in (None, DOWN_SHARD):
                raise ValueError(f"down_proj has no shard {shard_id!r}")
            self._load_slice(target, loaded, target.dim() - 1, full, 0, 0)
            return
        if shard_id is not None and shard_id not in GATE_UP_SHARDS:
            raise ValueError(f"unknown shard {shard_id!r}; gate_up_proj has {GATE_UP_SHARDS}")
        rows = target.dim() - 2
        for index, name in enumerate(GATE_UP_SHARDS):
            if shard_id is None:
                self._load_slice(target, loaded, rows, 2 * full, index * full, index * local)
            elif shard_id == name:
                self._load_slice(target, loaded, rows, full, 0, index * local)

    def _load_slice(
        self,
        target: torch.Tensor,
        loaded: LoadedWeight,
        dim: int,
        full_size: int,
        src_offset: int,
        dst_offset: int,
    ) -> None:
        """Copy this rank's `local_size` rows (or columns: `dim`) of the projection that starts
        at `src_offset` of `loaded` (`full_size` long on `dim`) to `dst_offset` of `target`."""
        shape = weight_shape(loaded)
        if len(shape) != target.dim() or shape[dim] != full_size:
            raise ValueError(
                f"checkpoint shape {shape} does not fit expert weight {tuple(target.shape)} "
                f"(dimension {dim} should be {full_size})"
            )
        local = self.local_size
        rank_rows = narrow_weight(loaded, dim, src_offset + self.tp_rank * local, local)
        copy_checked(target.narrow(dim, dst_offset, local), full_weight(rank_rows), "expert weight")

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out = ops.moe_experts(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) + experts: hidden [T, H] -> [T, H]."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Linear(spec.hidden_size, spec.num_experts)
        self.experts = FusedMoE(spec.num_experts, spec.hidden_size, spec.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, spec = self.gate(hidden), self.spec
        weights_dtype = hidden.dtype if spec.weights_in_model_dtype else torch.float32
        weights, ids = ops.moe_topk(logits, spec.top_k, spec.renormalize, weights_dtype)
        return self.experts(hidden, weights, ids)
