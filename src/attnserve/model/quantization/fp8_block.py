"""Block-wise FP8 checkpoints (`weight_block_size` [rows, columns]; 128 x 128 in the published
Qwen3 and DeepSeek FP8 checkpoints): linear weights in E4M3 with one float32 scale per block.

The weight keeps its E4M3 bytes as stored; its scales are kept per row and column block
([N, K / columns]: a block's scale on each of its rows), so merged projections whose parts are
not whole row blocks (a 64-row k_proj under 128-row blocks) and column-parallel shards need no
block alignment; a row-parallel layer's input columns must split on column blocks (checked).
Activations are quantized as the checkpoints were made for: per token and group of a block's
columns (w8a8 with DeepSeek's 1 x 128 activation groups). On CUDA the product is one Triton
GEMM that scales each K block's partial sums as it adds them (`fp8_gemm.scaled_mm` with
`group`); elsewhere torch ops compute the same definition (the activation groups and the weight
dequantized block by block, a float32 matmul).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.model.quantization.fp8 import Fp8LinearMethod, quantize_rows
from attnserve.model.quantization.fp8_checkpoint import Fp8Scheme
from attnserve.model.quantization.fp8_format import FP8
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    WeightLoader,
    default_weight_loader,
    full_shape,
    full_weight,
    set_row_store,
    set_weight_attrs,
)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] times the E4M3 weight [N, K] (scales [N, K / group], one per row and column
    group) transposed; x is quantized per token and group of `group` columns first."""
    rows, columns = x.shape
    quantized, x_scale = quantize_rows(x.reshape(-1, group))
    if x.is_cuda:
        from attnserve.model.quantization import fp8_gemm

        values, groups = quantized.reshape(rows, columns), x_scale.reshape(rows, -1)
        out = fp8_gemm.scaled_mm(values, groups, weight, scale, x.dtype, group=group)
    else:
        activations = (quantized.float() * x_scale[:, None]).reshape(rows, columns)
        out = (activations @ dequantize_blocks(weight, scale, group).t()).to(x.dtype)
    return out if bias is None else out + bias


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight [N, K] of E4M3 `weight` and its [N, K / group] scales."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group, group)
    return (grouped * scale[:, :, None]).reshape(out_features, in_features)


class Fp8BlockLinearMethod(Fp8LinearMethod):
    """One layer's block-wise FP8 weight and its scales (see the module docstring)."""

    takes_fp8_input = False  # its activations are quantized per group of columns, not per row

    def __init__(self, scheme: Fp8Scheme) -> None:
        super().__init__(scheme)
        if scheme.block_size is None:
            raise ValueError("a block-wise FP8 method needs the checkpoint's block size")
        self.block_rows, self.block_columns = scheme.block_size

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        if in_features % self.block_columns:
            raise ValueError(
                f"block-wise FP8: a layer of {in_features} input features does not split into "
                f"column blocks of {self.block_columns}"
            )
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        layer.weight = self.weight
        groups = in_features // self.block_columns
        scale = torch.full((out_features, groups), float("nan"), dtype=torch.float32)
        param = nn.Parameter(scale, requires_grad=False)
        layer.register_parameter(self.scale_name, param)
        self.scale = param
        set_row_store(self.weight, self._copy_fp8_rows, torch.get_default_dtype())
        set_weight_attrs(param, self._scale_loader(layer), (out_features, groups))

    def _scale_loader(self, layer: nn.Module) -> WeightLoader:
        """Loads a weight's [row blocks, column blocks] scales as one row of scales per weight
        row, sharded like the weight's rows, or in a row-parallel layer like its columns."""
        linear: Any = layer  # a parallel linear layer: its loader, specs, `shards_input`

        def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None) -> None:
            blocks = full_weight(loaded).float()
            full_rows = full_shape(self.weight)[0]
            rows = full_rows if shard_id is None else linear.specs[shard_id].full_size
            if blocks.dim() != 2 or blocks.shape[0] != -(-rows // self.block_rows):
                raise ValueError(
                    f"block-wise FP8: scales of shape {list(blocks.shape)} for {rows} rows in "
                    f"blocks of {self.block_rows}"
                )
            per_row = blocks.repeat_interleave(self.block_rows, dim=0)[:rows]
            set_weight_attrs(param, load, (full_rows, param.shape[1]))
            if linear.shards_input:
                default_weight_loader(param, self._rank_columns(linear, per_row), "weight scale")
            else:
                linear.weight_loader(param, per_row, shard_id)
            self.scale = param

        return load

    def _rank_columns(self, linear: Any, per_row: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's column groups of this rank."""
        groups = self.weight.shape[1] // self.block_columns
        return per_row.narrow(1, linear.tp_rank * groups, groups)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.scale, self.block_columns, bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.scale, self.block_columns)
