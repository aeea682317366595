"""`RMSNorm`, with a fused residual-add variant, computed in float32 like HF's Llama norm.

On CUDA (with Triton installed) each call is one fused Triton kernel (`fused_ops`) computing
the same math with the same roundings; on the CPU in float32, one native call (`cpu_ops`);
elsewhere, and as their reference, plain torch ops.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from attnserve.model.layers import cpu_ops

# ATTNSERVE_FUSED_OPS=0 keeps the plain torch ops on CUDA too.
_FUSED = (
    importlib.util.find_spec("triton") is not None
    and os.environ.get("ATTNSERVE_FUSED_OPS", "1") != "0"
)


def use_triton(x: torch.Tensor) -> bool:
    """Whether the model's layers run `x` through the fused Triton kernels of `fused_ops`: on
    CUDA when Triton is installed, unless ATTNSERVE_FUSED_OPS=0. (Tests monkeypatch this, in
    each layer module, to send CPU tensors through Triton's interpreter.) `fused_ops` is
    imported on first use only, so CPU-only installs never import Triton."""
    return x.is_cuda and _FUSED


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension; `x` may be [T, H, D] heads (Qwen3's q/k norm)."""
        if use_triton(x):
            from attnserve.model.layers.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if cpu_ops.use_cpu_ops(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        return self._norm(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `residual` to `x`, then normalise: returns (normed, new residual)."""
        if use_triton(x):
            from attnserve.model.layers.fused_ops import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_ops.use_cpu_ops(x) and residual.dtype == torch.float32:
            return cpu_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self._norm(summed), summed
