"""`Fp8Config`: which FP8 method each linear layer of a model gets (`quantization="fp8"`).

The model's projections take `Fp8LinearMethod` (float weights quantized on load, or an FP8
checkpoint's per-tensor or per-channel scales), or `Fp8BlockLinearMethod` for a checkpoint with
block-wise scales; replicated layers (MoE routers, whose logits pick the experts) stay in the
model's dtype, as in vLLM.
"""

from __future__ import annotations

from torch import nn

from attnserve.model.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from attnserve.model.quantization.fp8 import Fp8LinearMethod
from attnserve.model.quantization.fp8_block import Fp8BlockLinearMethod
from attnserve.model.quantization.fp8_checkpoint import Fp8Scheme


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, scheme: Fp8Scheme | None) -> None:
        self.scheme = scheme

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        """The model's projections in FP8; replicated layers (MoE routers, whose logits pick
        the experts) stay in the model's dtype, as in vLLM."""
        if not getattr(type(layer), "tensor_parallel", False):
            return UnquantizedLinearMethod()
        if self.scheme is not None and self.scheme.block_size is not None:
            return Fp8BlockLinearMethod(self.scheme)
        return Fp8LinearMethod(self.scheme)
