"""The numbers of the FP8 E4M3 format that the FP8 linear layers and their Triton activation
quantization share: the dtype, its largest finite value, and the smallest scale a row may get."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
MIN_SCALE = torch.finfo(torch.float32).tiny  # float32's smallest normal: an all-zero row's scale
