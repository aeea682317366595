"""Linear layers, replicated or tensor-parallel (vLLM's names and sharding).

Parameters start uninitialised (the loader fills them), so building a large model costs no
random init. A column-parallel layer keeps a slice of the output rows on each rank, a
row-parallel layer a slice of the input columns (its partial outputs are summed by an
all-reduce). A merged layer stacks several projections of the same input (gate/up, q/k/v) so
they run as one matmul; each rank stacks its own rows of each. `QKVParallelLinear` splits the
query heads across ranks and the KV heads too, replicating them when there are fewer KV heads
than ranks. Every sharded parameter has a `weight_loader` taking the FULL checkpoint weight (or
one named part of a merged one) and copying only this rank's shard.

How a layer holds its weight and multiplies with it is its `quant_method` (vLLM's name), taken
from the quantization active while the model is built (`model.quantization`): plain weights in
the model's dtype unless a quantization is active. The loaders write rows with `store_rows`, so
a quantized weight is quantized (or kept as the checkpoint's) row range by row range. A layer
whose method takes FP8 input also multiplies an `Fp8Activation` (rows quantized by the op before
it: `fuse_input_quantization` wires a norm or activation to hand it that).

A layer may carry an `OutputAddend` (`lora`, set by the LoRA package on its target projections):
it adds each row's adapter product to the layer's output on this rank, before a row-parallel
layer's all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from attnserve.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from attnserve.model.quantization import linear_method_for
from attnserve.model.quantization.fp8_format import Fp8Activation, LinearInput
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    default_weight_loader,
    full_shape,
    narrow_weight,
    set_weight_attrs,
    store_rows,
    weight_shape,
)


class OutputAddend(Protocol):
    """What a layer's `lora` adds to its output on this rank (`x` float, `out` = x W^T)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...


class Linear(nn.Module):
    """A linear layer whose weights every rank holds whole (vLLM's ReplicatedLinear; the MoE
    routers). `tensor_parallel`: a sharded projection of the model (column- or row-parallel);
    `shards_input`: its input features are split across ranks (row-parallel)."""

    tensor_parallel: ClassVar[bool] = False
    shards_input: ClassVar[bool] = False
    weight: nn.Parameter  # registered by the quant method

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.quant_method = linear_method_for(self)
        self.quant_method.create_weights(self, out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora: OutputAddend | None = None

    def forward(self, x: LinearInput) -> torch.Tensor:
        return self.multiply(x, self.bias)

    def multiply(self, x: LinearInput, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank, x float or quantized per row, plus `lora`'s addend."""
        if isinstance(x, Fp8Activation):
            return self.quant_method.apply_fp8(self, x, bias)
        out = self.quant_method.apply(self, x, bias)
        return out if self.lora is None else self.lora(x, out)


class QuantizingProducer(Protocol):
    """A norm or activation that can write its output quantized for the layer it feeds."""

    supports_fp8_output: ClassVar[bool]
    output_fp8: bool


def fuse_input_quantization(producer: QuantizingProducer, consumer: Linear) -> None:
    """Let `producer`, whose output only `consumer` reads, hand it over quantized (one launch
    fewer per call) where the producer can and the consumer's method takes FP8 input."""
    producer.output_fp8 = producer.supports_fp8_output and consumer.quant_method.takes_fp8_input


def _check_full_size(param: nn.Parameter, loaded: LoadedWeight, dim: int, expected: int) -> None:
    if weight_shape(loaded)[dim] != expected:
        raise ValueError(
            f"checkpoint shape {weight_shape(loaded)} does not match the full weight "
            f"{full_shape(param)} (dimension {dim} should be {expected})"
        )


def load_rank_slice(
    param: nn.Parameter, loaded: LoadedWeight, dim: int, tp: tuple[int, int], what: str
) -> None:
    """Copy rank `tp[0]` of `tp[1]`'s equal slice along `dim` of the full `loaded` weight."""
    tp_rank, tp_size = tp
    if tp_size == 1:
        default_weight_loader(param, loaded, what)
        return
    _check_full_size(param, loaded, dim, full_shape(param)[dim])
    size = param.shape[dim]
    store_rows(param, 0, narrow_weight(loaded, dim, tp_rank * size, size), what)


class ColumnParallelLinear(Linear):
    """Y = X A^T with A's output rows split across ranks; each rank returns its slice of Y
    (or, with `gather_output`, all of it)."""

    tensor_parallel = True

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        output_size_per_partition: int | None = None,
    ) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        local = output_size_per_partition or divide(output_size, self.tp_size)
        super().__init__(input_size, local, bias)
        self.gather_output = gather_output
        set_weight_attrs(self.weight, self.weight_loader, (output_size, input_size))
        if self.bias is not None:
            set_weight_attrs(self.bias, self.weight_loader, (output_size,))

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None
    ) -> None:
        load_rank_slice(param, loaded, 0, (self.tp_rank, self.tp_size), "column-parallel weight")

    def forward(self, x: LinearInput) -> torch.Tensor:
        out = self.multiply(x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


@dataclass(frozen=True)
class ShardSpec:
    """Where one projection of a merged layer lives, in the full and in this rank's weight."""

    full_offset: int  # first row of the projection in the full merged weight
    full_size: int  # rows of the whole projection
    local_offset: int  # first row of this rank's part in its merged weight
    local_size: int  # rows this rank keeps
    rank_start: int  # first row this rank keeps, within the projection


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input, stacked (e.g. gate and up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        shard_names: Sequence[str],
        bias: bool = False,
        local_sizes: Sequence[int] | None = None,
        rank_starts: Sequence[int] | None = None,
    ) -> None:
        if len(output_sizes) != len(shard_names):
            raise ValueError("one name per output size")
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        local = list(local_sizes or [divide(size, tp_size) for size in output_sizes])
        starts = list(rank_starts or [tp_rank * size for size in local])
        super().__init__(input_size, sum(output_sizes), bias, output_size_per_partition=sum(local))
        self.specs: dict[str, ShardSpec] = {}
        for i, name in enumerate(shard_names):
            full_offset, local_offset = sum(output_sizes[:i]), sum(local[:i])
            self.specs[name] = ShardSpec(
                full_offset, output_sizes[i], local_offset, local[i], starts[i]
            )
        self.shards = {name: (s.local_offset, s.local_size) for name, s in self.specs.items()}

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None
    ) -> None:
        """`shard_id` None: `loaded` is the whole merged weight; else one projection of it."""
        if shard_id is None:
            if self.tp_size == 1:
                default_weight_loader(param, loaded, "merged weight")
                return
            _check_full_size(param, loaded, 0, full_shape(param)[0])
            for spec in self.specs.values():
                self._load_rows(param, loaded, spec, spec.full_offset)
            return
        if shard_id not in self.specs:
            raise ValueError(f"unknown shard {shard_id!r}; this layer has {list(self.specs)}")
        spec = self.specs[shard_id]
        _check_full_size(param, loaded, 0, spec.full_size)
        self._load_rows(param, loaded, spec, 0)

    @staticmethod
    def _load_rows(param: nn.Parameter, loaded: LoadedWeight, spec: ShardSpec, base: int) -> None:
        rows = narrow_weight(loaded, 0, base + spec.rank_start, spec.local_size)
        store_rows(param, spec.local_offset, rows, "merged shard")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v of the attention heads, merged; each rank computes its own heads. With fewer
    KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, replicas = 1, divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads, replicas = divide(total_num_kv_heads, tp_size), 1
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        self.kv_head_start = (tp_rank // replicas) * self.num_kv_heads  # this rank's first
        kv_start = self.kv_head_start * head_size
        super().__init__(
            hidden_size,
            [total_num_heads * head_size] + [total_num_kv_heads * head_size] * 2,
            ["q", "k", "v"],
            bias,
            local_sizes=[q_size, kv_size, kv_size],
            rank_starts=[tp_rank * q_size, kv_start, kv_start],
        )


class RowParallelLinear(Linear):
    """Y = X A^T with A's input columns split across ranks: each rank multiplies its slice of X
    (the output of a column-parallel layer) and an all-reduce sums the partial results."""

    tensor_parallel = True
    shards_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        super().__init__(divide(input_size, self.tp_size), output_size, bias)
        set_weight_attrs(self.weight, self.weight_loader, (output_size, input_size))

    def weight_loader(
        self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None
    ) -> None:
        load_rank_slice(param, loaded, 1, (self.tp_rank, self.tp_size), "row-parallel weight")

    def forward(self, x: LinearInput) -> torch.Tensor:
        if self.tp_size == 1:
            return self.multiply(x, self.bias)
        out = tensor_model_parallel_all_reduce(self.multiply(x, None))
        return out if self.bias is None else out + self.bias
