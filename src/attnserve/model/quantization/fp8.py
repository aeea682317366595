"""`quantization="fp8"`: linear layers in FP8 E4M3 through `torch._scaled_mm` (cuBLASLt on
Ada/Hopper; torch's CPU kernel elsewhere).

Weights are E4M3 [N, K] with one float32 scale per output row (w = q * scale); activations are
quantized per token as they come (scale = the row's max |x| / 448), and `_scaled_mm` applies
both scales to its float32 accumulators, row-wise (scale_a [M, 1], scale_b [1, N]; the weight
goes in transposed, a column-major view). The embedding, the LM head and replicated layers (MoE
routers) stay in the model's dtype, as in vLLM; MoE experts (not linear layers) too.

Float checkpoints (and dummy weights) are quantized on load, each rank's rows as its loader
stores them, so no full-precision copy of the model is ever held. FP8 checkpoints
(`fp8_checkpoint`) load as they are: per-tensor scales become per-row ones (the same value on
each row of the tensor, exactly), sharded with the rows (column-parallel) or whole on every rank
(row-parallel, whose rows are not split).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from attnserve.model.quantization.base import LinearMethod
from attnserve.model.quantization.fp8_checkpoint import Fp8Scheme
from attnserve.model.quantization.fp8_format import FP8, FP8_MAX, MIN_SCALE, Fp8Activation
from attnserve.model.quantization.weight_utils import (
    LoadedWeight,
    WeightLoader,
    default_weight_loader,
    full_shape,
    full_weight,
    set_row_store,
    set_weight_attrs,
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], float32 scales [M]) with x ~ q * scale per row; activations
    on CUDA in one launch (`fp8_quant`), the same values."""
    if x.is_cuda:
        from attnserve.model.quantization import fp8_quant

        return fp8_quant.quantize_rows(x)
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    quantized = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized, scale.squeeze(-1)


def fp8_matmul(
    x: Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows quantized per row times the E4M3 weight [N, K] (float32 row scales [N])
    transposed, in `out_dtype`: on CUDA by the Triton GEMM where `fp8_gemm.pick_config` takes
    it for the shape, else by torch's `_scaled_mm` (whose CUDA row-wise mode writes bfloat16
    only: cast after)."""
    values, x_scale = x
    if values.shape[0] == 0:
        return torch.empty(0, weight.shape[0], dtype=out_dtype, device=values.device)
    out = _triton_matmul(x, weight, weight_scale, out_dtype) if values.is_cuda else None
    if out is None:
        out = torch._scaled_mm(
            values, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :],
            out_dtype=torch.bfloat16 if values.is_cuda else out_dtype,
        ).to(out_dtype)  # fmt: skip
    return out if bias is None else out + bias


def _triton_matmul(
    x: Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """The product by `fp8_gemm`'s kernel, or None where it is not the faster GEMM."""
    from attnserve.model.quantization import fp8_gemm

    config = fp8_gemm.pick_config(x.values.shape[0], *weight.shape)
    if config is None:
        return None
    return fp8_gemm.scaled_mm(x.values, x.scale, weight, weight_scale, out_dtype, config=config)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] (float) quantized per row, times the E4M3 weight [N, K] (float32 row scales
    [N]) transposed, in x's dtype."""
    return fp8_matmul(Fp8Activation(*quantize_rows(x)), weight, weight_scale, bias, x.dtype)


class Fp8LinearMethod(LinearMethod):
    """`scheme` None: quantize float weights on load; else load the checkpoint's FP8 weights
    and their scales (named `scheme.scale_name`). One method object per layer: it keeps the
    layer's weight and scales. It takes inputs quantized per row by the op before it."""

    takes_fp8_input = True

    def __init__(self, scheme: Fp8Scheme | None) -> None:
        self.scheme = scheme
        self.scale_name = "weight_scale" if scheme is None else scheme.scale_name
        self.weight = nn.Parameter(torch.empty(0, dtype=FP8), requires_grad=False)
        self.scale = torch.empty(0)
        self.out_dtype = torch.get_default_dtype()  # the model's dtype, as the layer is built

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        if torch.get_default_device().type == "cuda" and (in_features % 16 or out_features % 16):
            raise ValueError(
                f"fp8: a {out_features} x {in_features} linear layer; FP8 matmuls on CUDA need "
                "both sizes to be multiples of 16"
            )
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), False)
        layer.weight = self.weight
        scale = torch.full((out_features,), float("nan"), dtype=torch.float32)
        if self.scheme is None:
            layer.register_buffer(self.scale_name, scale)
            self.scale = scale
            set_row_store(self.weight, self._quantize_rows, torch.get_default_dtype())
            return
        param = nn.Parameter(scale, requires_grad=False)
        layer.register_parameter(self.scale_name, param)
        self.scale = param
        set_row_store(self.weight, self._copy_fp8_rows, torch.get_default_dtype())
        set_weight_attrs(param, self._scale_loader(layer), (out_features,))

    def _quantize_rows(self, offset: int, rows: LoadedWeight) -> None:
        loaded = full_weight(rows).to(self.weight.device)
        if loaded.dtype == FP8:
            raise ValueError("fp8: an FP8 weight in a checkpoint without an FP8 "
                             "quantization_config (its scales are unknown)")  # fmt: skip
        self._check_columns(loaded)
        quantized, scale = quantize_rows(loaded)
        self.weight.data[offset : offset + len(loaded)] = quantized
        self.scale.data[offset : offset + len(loaded)] = scale

    def _copy_fp8_rows(self, offset: int, rows: LoadedWeight) -> None:
        loaded = full_weight(rows)
        if loaded.dtype != FP8:
            raise ValueError(f"fp8: an FP8 checkpoint holds a {loaded.dtype} linear weight "
                             "(mixed precision checkpoints are not supported)")  # fmt: skip
        self._check_columns(loaded)
        self.weight.data[offset : offset + len(loaded)] = loaded

    def _check_columns(self, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[1] != self.weight.shape[1]:
            raise ValueError(
                f"fp8: checkpoint rows {tuple(loaded.shape)} do not fit the weight "
                f"{tuple(self.weight.shape)}"
            )

    def _scale_loader(self, layer: nn.Module) -> WeightLoader:
        """Loads a per-tensor or per-row scale: sharded like the weight's rows, except in a
        row-parallel layer (whose rows every rank holds whole)."""
        linear: Any = layer  # a parallel linear layer: its loader, specs, `shards_input`

        def load(param: nn.Parameter, loaded: LoadedWeight, shard_id: str | None = None) -> None:
            values = full_weight(loaded).float().reshape(-1)
            full_rows = full_shape(self.weight)[0]
            rows = full_rows if shard_id is None else linear.specs[shard_id].full_size
            if values.numel() == 1:
                values = values.expand(rows).contiguous()
            set_weight_attrs(param, load, (full_rows,))
            if linear.shards_input:
                default_weight_loader(param, values, "weight scale")
            else:
                linear.weight_loader(param, values, shard_id)
            self.scale = param

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.scale = getattr(layer, self.scale_name)  # a zero-copy load may have replaced it
        if torch.isnan(self.scale).any():
            raise ValueError(
                f"fp8: a {type(layer).__name__} has rows without a {self.scale_name} "
                "(the checkpoint lacks some scales)"
            )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, bias)

    def apply_fp8(
        self, layer: nn.Module, x: Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_matmul(x, self.weight, self.scale, bias, self.out_dtype)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]
