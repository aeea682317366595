"""Rotary position embedding (GPT-NeoX / HF Llama "rotate half" style): plain, linearly scaled
or Llama-3 scaled.

The cos/sin table for every position up to `max_position` is built once, in float32, on the
module's device; a forward gathers the rows of the batch's positions (`ops.rotary_embedding`:
one fused Triton kernel for q and k on CUDA, one native call on the CPU in float32, plain torch
elsewhere). `forward_qkv` readies an attention layer's whole q, k, v: Qwen3's per-head q/k norm,
the rotation and the copy of v (`ops.qkv_rotary_embedding`: one launch on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from attnserve.model.layers import ops
from attnserve.model.layers.layernorm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency rescaling: long wavelengths divided by `factor`, short ones kept,
    the band between interpolated smoothly."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    head_size: int, base: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """The per-pair inverse frequencies [head_size / 2] in float32."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
    inv_freq = 1.0 / (base**exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if scaling is not None and rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    if scaling is not None and rope_type == "linear":  # positions divided by `factor`
        inv_freq = inv_freq / float(scaling["factor"])
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        max_position: int,
        base: float,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = rope_inv_freq(head_size, base, scaling)
        device = torch.get_default_device()
        angles = torch.outer(
            torch.arange(max_position, dtype=torch.float32, device=device),
            inv_freq.to(device),
        )
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), -1), False)
        self.cos_sin_cache: torch.Tensor

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H*D] and key [T, Hkv*D] by their tokens' positions [T]; returns new
        tensors (the inputs are left as they are)."""
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)

    def forward_qkv(
        self,
        positions: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        head_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An attention layer's q, k, v [T, H*D] (splits of its qkv projection) ready for
        attention: q and k per-head normalised by `head_norms` (Qwen3's q/k norm) when given,
        then rotated; v contiguous."""
        norms = None
        if head_norms is not None:
            q_norm, k_norm = head_norms
            norms = (
                (q_norm.weight, q_norm.eps, q_norm.unit_offset),
                (k_norm.weight, k_norm.eps, k_norm.unit_offset),
            )
        return ops.qkv_rotary_embedding(positions, qkv, self.cos_sin_cache, self.head_size, norms)
