"""`RMSNorm`, with a fused residual-add variant, computed in float32 like HF's Llama norm
(`ops.rms_norm`, `ops.fused_add_rms_norm`: one fused Triton kernel on CUDA, one native call on
the CPU in float32, plain torch elsewhere and as their reference), and Gemma's `GemmaRMSNorm`
(a scale of 1 + weight, in plain torch).

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
    # whether `ops.qkv_rotary_embedding` may apply it as a q/k head norm from (weight, eps)
    fusable_head_norm: ClassVar[bool] = True
    # whether `forward_to_linear` can hand an FP8 layer its input quantized
    supports_fp8_output: ClassVar[bool] = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.output_fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension; `x` may be [T, H, D] heads (Qwen3's q/k norm)."""
        return ops.rms_norm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add `residual` to `x`, then normalise: returns (normed, new residual)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def forward_to_linear(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[LinearInput, torch.Tensor]:
        """A decoder layer's norm before its projection: `residual` (if any) added to `x`, the
        sum normalised (quantized when `output_fp8`); returns (normed, residual stream)."""
        if self.output_fp8:
            normed, summed = ops.rms_norm_fp8(x, residual, self.weight, self.eps)
            return normed, x if summed is None else summed
        if residual is None:
            return self(x), x
        return self.forward_with_residual(x, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, as HF computes it: x / rms(x) * (1 + weight), all in float32, rounded
    to x's dtype once at the end (plain torch; the stored weight is the offset from one)."""

    fusable_head_norm: ClassVar[bool] = False
    supports_fp8_output: ClassVar[bool] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.forward(summed), summed
