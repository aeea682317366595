"""The FP8 E4M3 format as the FP8 linear layers and the kernels that feed them share it: the
dtype, its largest finite value, the smallest scale a row may get, and `Fp8Activation`, a
layer's input quantized per row (what a fused norm or activation hands an FP8 linear layer)."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_SCALE = torch.finfo(torch.float32).tiny  # float32's smallest normal: an all-zero row's scale


class Fp8Activation(NamedTuple):
    """Activations quantized per row: x ~ values * scale[:, None]."""

    values: torch.Tensor  # E4M3 [M, K]
    scale: torch.Tensor  # float32 [M]


LinearInput = torch.Tensor | Fp8Activation  # what a linear layer multiplies
