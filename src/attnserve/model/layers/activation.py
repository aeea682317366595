"""`SiluAndMul`: the gated activation of a merged gate/up projection (one fused Triton kernel on
CUDA, `fused_ops.silu_and_mul`; one native call on the CPU in float32, `cpu_ops`; plain torch
elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.model.layers import cpu_ops
from attnserve.model.layers.layernorm import use_triton


class SiluAndMul(nn.Module):
    """x = [gate | up] on the last dimension -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from attnserve.model.layers.fused_ops import silu_and_mul

            return silu_and_mul(x)
        if cpu_ops.use_cpu_ops(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
