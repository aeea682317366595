"""Gated activations of a merged gate/up projection: `SiluAndMul` (`ops.silu_and_mul`: one fused
Triton kernel on CUDA, one native call on the CPU in float32, plain torch elsewhere) and Gemma's
`GeluTanhAndMul` (plain torch, as HF's `gelu_pytorch_tanh` computes it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.model.layers import ops


class SiluAndMul(nn.Module):
    """x = [gate | up] on the last dimension -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] on the last dimension -> gelu_tanh(gate) * up (GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
