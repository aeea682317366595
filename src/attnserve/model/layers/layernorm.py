"""`RMSNorm`, with a fused residual-add variant, computed in float32 like HF's Llama norm
(`ops.rms_norm`, `ops.fused_add_rms_norm`: one fused Triton kernel on CUDA, one native call on
the CPU in float32, plain torch elsewhere and as their reference), and Gemma's `GemmaRMSNorm`
(a scale of 1 + weight, all in float32: the same ops with `unit_offset`).

A decoder layer's norm before a projection runs `forward_to_linear`: when the projection is an
FP8 layer that takes quantized input (`output_fp8`, set by `linear.fuse_input_quantization`),
the norm writes its output in E4M3 with per-row scales in the same launch (`ops.rms_norm_fp8`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from attnserve.model.layers import ops
from attnserve.model.quantization.fp8_format import LinearInput


class RMSNorm(nn.Module):
    # whether `forward_to_linear` can hand an FP8 layer its input quantized
    supports_fp8_output: ClassVar[bool] = True
    # Gemma's norm: the weight stored as its offset from one, no rounding before the scale
    unit_offset: ClassVar[bool] = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.output_fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension; `x` may be [T, H, D] heads (Qwen3's q/k norm)."""
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `residual` to `x`, then normalise: returns (normed, new residual)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)

    def forward_to_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        """A decoder layer's norm before its projection: `residual` (if any) added to `x`, the
        sum normalised (quantized when `output_fp8`); returns (normed, residual stream)."""
        if self.output_fp8:
            normed, summed = ops.rms_norm_fp8(x, residual, self.weight, self.eps, self.unit_offset)
            return normed, x if summed is None else summed
        if residual is None:
            return self(x), x
        return self.forward_with_residual(x, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, as HF computes it: x / rms(x) * (1 + weight), all in float32, rounded
    to x's dtype once at the end (the stored weight is the offset from one)."""

    unit_offset = True
