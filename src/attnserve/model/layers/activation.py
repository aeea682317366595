"""`SiluAndMul`: the gated activation of a merged gate/up projection (`ops.silu_and_mul`: one
fused Triton kernel on CUDA, one native call on the CPU in float32, plain torch elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from attnserve.model.layers import ops


class SiluAndMul(nn.Module):
    """x = [gate | up] on the last dimension -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
