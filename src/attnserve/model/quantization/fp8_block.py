"""Block-wise FP8 checkpoints (`weight_block_size` [rows, columns]; 128 x 128 in the published
Qwen3 and DeepSeek FP8 checkpoints): linear weights in E4M3 with one float32 scale per block.

The weight keeps its E4M3 bytes as stored; its scales are kept per row and column block
([N, K / columns]: a block's scale on each of its rows), so merged projections whose parts are
not whole row blocks (a 64-row k_proj under 128-row blocks) and column-parallel shards need no
block alignment; a row-parallel layer's input columns must split on column blocks (checked).
Activations are quantized as the checkpoints were made for: per token and group of a block's
columns (w8a8 with DeepSeek's 1 x 128 activation groups), by one Triton launch on CUDA
(`fp8_quant.quantize_groups`). On CUDA the product is cuBLAS's block-scaled GEMM (torch's
`scaled_mm` with 1 x 128 activation and 128 x 128 weight scales; Hopper, torch 2.11+) for more
than 16 rows where the weight's scales come in whole 128 x 128 blocks, else one Triton GEMM that
scales each K block's partial sums as it adds them (`fp8_gemm.scaled_mm` with `group`). On the
H200 cuBLAS's took 1.9-2.2x less time than the Triton GEMM's best tile from 2,048 rows and
1.0-1.9x at 128, and up to 16 rows the Triton GEMM is within 10% of the per-channel layer's
(docs/benchmarks.md).
Elsewhere torch ops compute the same definition (the activation groups and the weight
dequantized block by block, a float32 matmul).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
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

logger = logging.getLogger(__name__)

CUBLAS_BLOCK = 128  # cuBLAS's block scaling: 1 x 128 activations, 128 x 128 weights
TRITON_MAX_ROWS = 16  # up to here the Triton GEMM (split over K) is the faster one


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] times the E4M3 weight [N, K] (scales [N, K / group], one per row and column
    group) transposed; x is quantized per token and group of `group` columns first. `blocks`:
    the same scales as [N / 128, K / 128] blocks (`uniform_blocks`) where cuBLAS's GEMM runs
    on x's device (`cublas_block_scaled`); None: the Triton GEMM at every size."""
    if x.is_cuda:
        out = _cuda_block_linear(x, weight, scale, group, blocks)
    else:
        rows, columns = x.shape
        quantized, x_scale = quantize_rows(x.reshape(-1, group))
        activations = (quantized.float() * x_scale[:, None]).reshape(rows, columns)
        out = (activations @ dequantize_blocks(weight, scale, group).t()).to(x.dtype)
    return out if bias is None else out + bias


def _cuda_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    blocks: torch.Tensor | None,
) -> torch.Tensor:
    from attnserve.model.quantization import fp8_gemm, fp8_quant

    rows = x.shape[0]
    if blocks is not None and rows > TRITON_MAX_ROWS:
        # cuBLAS reads the column-major activation scales with a stride of a multiple of 4 rows
        values, x_scale = fp8_quant.quantize_groups(x, group, row_multiple=4)
        return _cublas_product(values, x_scale, weight, blocks, x.dtype)[:rows]
    values, x_scale = fp8_quant.quantize_groups(x, group)
    return fp8_gemm.scaled_mm(values, x_scale, weight, scale, x.dtype, group=group)


def _cublas_product(
    values: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    blocks: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    recipe = F.ScalingType
    product: torch.Tensor = F.scaled_mm(
        values, weight.t(), x_scale, recipe.BlockWise1x128, blocks.t(), recipe.BlockWise128x128,
        output_dtype=out_dtype,
    )  # fmt: skip
    return product


@functools.lru_cache(maxsize=8)
def cublas_block_scaled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch runs cuBLAS's block-scaled FP8 GEMM on `device` with `dtype` output
    (Hopper, torch 2.11+ built for CUDA 12.9+): asked once per device and dtype as the weights
    are loaded (never while a CUDA graph is captured), by one small product checked against
    the Triton GEMM's."""
    from attnserve.model.quantization import fp8_gemm, fp8_quant

    if not hasattr(F, "scaled_mm") or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    x = torch.linspace(-1.0, 1.0, 4 * 512, device=device).reshape(4, 512)
    weight = torch.linspace(-1.0, 1.0, 256 * 512, device=device).reshape(256, 512).to(FP8)
    blocks = torch.full((2, 4), 0.5, device=device)
    values, x_scale = fp8_quant.quantize_groups(x, CUBLAS_BLOCK, row_multiple=4)
    per_row = blocks.repeat_interleave(CUBLAS_BLOCK, 0)
    want = fp8_gemm.scaled_mm(values, x_scale, weight, per_row, dtype, CUBLAS_BLOCK)
    try:
        got = _cublas_product(values, x_scale, weight, blocks, dtype)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        logger.info("block-wise FP8 without cuBLAS's block-scaled GEMM: %s", error)
        return False
    return bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))


def uniform_blocks(scale: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor | None:
    """A weight's per-row scales [N, K / 128] as the [N / 128, K / 128] blocks cuBLAS takes,
    where the blocks are 128 x 128, N is a multiple of 128 and each 128 rows share their scales
    (the parts of a merged projection start on block rows), and K / 128 is a multiple of 4;
    else None (the Triton GEMM takes the per-row scales)."""
    rows, groups = scale.shape
    if block_size != (CUBLAS_BLOCK, CUBLAS_BLOCK) or rows % CUBLAS_BLOCK or groups % 4:
        return None
    blocks = scale[::CUBLAS_BLOCK].contiguous()
    if not torch.equal(blocks.repeat_interleave(CUBLAS_BLOCK, 0), scale):
        return None
    return blocks


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
        self.blocks: torch.Tensor | None = None  # the scales for cuBLAS (`uniform_blocks`)

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

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        blocks = uniform_blocks(self.scale, (self.block_rows, self.block_columns))
        cuda = blocks is not None and blocks.is_cuda
        if cuda and cublas_block_scaled(self.scale.device, self.out_dtype):
            self.blocks = blocks

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_block_linear(
            x, self.weight, self.scale, self.block_columns, bias, self.blocks
        )  # fmt: skip

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.scale, self.block_columns)
