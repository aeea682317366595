"""Gated activations of a merged gate/up projection: `SiluAndMul` (`ops.silu_and_mul`: one fused
Triton kernel on CUDA, one native call on the CPU in float32, plain torch elsewhere) and Gemma's
`GeluTanhAndMul` (`ops.gelu_tanh_and_mul`, as HF's `gelu_pytorch_tanh` computes it: one fused
Triton kernel on CUDA, plain torch elsewhere).

The MLP runs `forward_to_linear` before its down projection: either writes its output in
E4M3 with per-row scales in the same launch when that projection is an FP8 layer that takes
quantized input (`output_fp8`, set by `linear.fuse_input_quantization`)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from attnserve.model.layers import ops
from attnserve.model.quantization.fp8_format import LinearInput


class GatedActivation(nn.Module):
    """act(gate) * up of x = [gate | up] on the last dimension."""

    supports_fp8_output: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.output_fp8 = False

    def forward_to_linear(self, x: torch.Tensor) -> LinearInput:
        """The activation as the next projection takes it (quantized when `output_fp8`)."""
        out: torch.Tensor = self(x)
        return out


class SiluAndMul(GatedActivation):
    """x = [gate | up] on the last dimension -> silu(gate) * up."""

    supports_fp8_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)

    def forward_to_linear(self, x: torch.Tensor) -> LinearInput:
        return ops.silu_and_mul_fp8(x) if self.output_fp8 else self(x)


class GeluTanhAndMul(GatedActivation):
    """x = [gate | up] on the last dimension -> gelu_tanh(gate) * up (GeGLU)."""

    supports_fp8_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh_and_mul(x)

    def forward_to_linear(self, x: torch.Tensor) -> LinearInput:
        return ops.gelu_tanh_and_mul_fp8(x) if self.output_fp8 else self(x)
