"""GGUF blocks through torch's own CPU int4 kernel (`torch._weight_int4pack_mm_for_cpu`): the
path where the native kernels (`gguf_cpu`) cannot be built, and their independent cross-check.

torch's kernel computes, per group of 32 input features, w = (q - 8) * scale + zero from 4-bit
codes q. GGUF's blocks are exactly such groups:
- Q4_0, w = d * (q - 8): scale = d, zero = 0;
- Q4_1, w = d * q + m: scale = d, zero = m + 8 d;
- Q8_0, w = d * q with q in -128..127: q + 128 = 16 h + l with h, l in 0..15, so
  w = 16 d * (h - 8) + (d * (l - 8) + 8 d): two 4-bit planes (h: scale 16 d, zero 0; l: scale
  d, zero 8 d) whose products add up to the Q8_0 product, with no loss.
The kernel packs N rows in multiples of 16: padding rows have scale and zero 0 (they multiply to
zero) and are cut off the output. Scales are float32 and activations are multiplied in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.model.quantization.gguf_blocks import BLOCK, GGUFWeight

_ROW_MULTIPLE = 16  # torch's packing takes N in multiples of 16
_INNER_K_TILES = 2


@dataclass(frozen=True)
class _Plane:
    packed: torch.Tensor  # torch's int4 layout of [N_padded, K]
    scales_and_zeros: torch.Tensor  # [K / 32, N_padded, 2] float32


def _plane(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> _Plane:
    """codes [N, K] in 0..15, scale and zero [N, K/32], padded to whole packing rows."""
    pad = -codes.shape[0] % _ROW_MULTIPLE
    codes = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8)
    scale = torch.nn.functional.pad(scale, (0, 0, 0, pad))
    zero = torch.nn.functional.pad(zero, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return _Plane(packed, scales_and_zeros)


@dataclass(frozen=True)
class TorchPackedWeight:
    """A GGUF weight [rows, K] as one (Q4_0, Q4_1) or two (Q8_0) planes of torch's kernel, and
    its blocks (for dequantizing)."""

    weight: GGUFWeight
    planes: tuple[_Plane, ...]

    @property
    def qtype(self) -> str:
        return self.weight.qtype

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_gguf(cls, weight: GGUFWeight) -> TorchPackedWeight:
        d = weight.scales()
        if weight.qtype == "Q4_0":
            planes: tuple[_Plane, ...] = (_plane(weight.codes(), d, torch.zeros_like(d)),)
        elif weight.qtype == "Q4_1":
            planes = (_plane(weight.codes(), d, weight.mins() + 8 * d),)
        else:
            unsigned = weight.codes().to(torch.int32) + 128
            planes = (
                _plane(unsigned >> 4, 16 * d, torch.zeros_like(d)),
                _plane(unsigned & 0x0F, d, 8 * d),
            )
        return cls(weight, planes)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] times the weight transposed: float32 [M, rows]."""
        x32 = x.to(torch.float32).contiguous()
        first, *rest = self.planes
        out = _plane_mm(x32, first)
        for plane in rest:
            out.add_(_plane_mm(x32, plane))
        return out[:, : self.rows]

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return GGUFWeight(self.qtype, self.weight.blocks[ids]).dequantize()

    def dequantize(self) -> torch.Tensor:
        return self.weight.dequantize()


def _plane_mm(x: torch.Tensor, plane: _Plane) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, plane.packed, BLOCK, plane.scales_and_zeros
    )
