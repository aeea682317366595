"""GGUF's 32-weight block formats kept quantized: Q4_0, Q4_1 and Q8_0, as the file stores them.

A `GGUFWeight` [N, K] is the file's raw blocks, `blocks` uint8 [N, K/32, block bytes]: each block
is float16 d, (Q4_1) float16 m, then the codes (Q4: 16 bytes, code j in the low nibble of byte j
and code j + 16 in the high one; Q8_0: 32 int8). A weight is d * (q - 8) for Q4_0, d * q + m for
Q4_1 and d * q for Q8_0, as in `gguf.quants.dequantize`. It slices like a lazy safetensors slice
(`get_shape`, `[rows, cols]`, columns on block boundaries only), so the tensor-parallel weight
loaders narrow it as they narrow any checkpoint weight; `rows` applies a row operation (llama.cpp's
q/k permutation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BLOCK = 32
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
BLOCK_BYTES = {"Q4_0": 2 + BLOCK // 2, "Q4_1": 4 + BLOCK // 2, "Q8_0": 2 + BLOCK}
CODES_AT = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # first code byte of a block


@dataclass(frozen=True)
class GGUFWeight:
    qtype: str
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), int(self.blocks.shape[1]) * BLOCK)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> GGUFWeight:
        """Rows and/or columns by unit-step slices (or `...`: all); columns must start and end
        on blocks."""
        rows, cols = _two_slices(index)
        start, stop, _ = cols.indices(self.shape[1])
        if start % BLOCK or stop % BLOCK:
            raise ValueError(
                f"a {self.qtype} weight splits only on its {BLOCK}-column blocks, got columns "
                f"{start}:{stop} (under tensor parallelism each rank's share of the input "
                f"features must be a multiple of {BLOCK})"
            )
        return GGUFWeight(self.qtype, self.blocks[rows, start // BLOCK : stop // BLOCK])

    def rows(self, operation: Callable[[torch.Tensor], torch.Tensor]) -> GGUFWeight:
        """`operation` (one that only moves whole rows) applied to the blocks."""
        return GGUFWeight(self.qtype, operation(self.blocks))

    def scales(self) -> torch.Tensor:
        """Each block's d, float32 [N, K/32]."""
        return _float16_at(self.blocks, 0)

    def mins(self) -> torch.Tensor:
        """Each block's m, float32 [N, K/32] (Q4_1 only)."""
        if self.qtype != "Q4_1":
            raise ValueError(f"{self.qtype} blocks have no m")
        return _float16_at(self.blocks, 2)

    def codes(self) -> torch.Tensor:
        """The codes, one per weight [N, K]: uint8 0..15 (Q4_0, Q4_1) or int8 (Q8_0)."""
        raw = self.blocks[..., CODES_AT[self.qtype] :]
        if self.qtype == "Q8_0":
            return raw.contiguous().view(torch.int8).reshape(self.shape)
        return torch.cat([raw & 0x0F, raw >> 4], dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], as `gguf.quants.dequantize` computes it."""
        scales = self.scales().repeat_interleave(BLOCK, dim=1)
        codes = self.codes().float()
        if self.qtype == "Q4_0":
            return (codes - 8) * scales
        if self.qtype == "Q4_1":
            return codes * scales + self.mins().repeat_interleave(BLOCK, dim=1)
        return codes * scales


def _two_slices(index: Any) -> tuple[slice, slice]:
    if index is Ellipsis:
        return slice(None), slice(None)
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > 2 or not all(isinstance(p, slice) and p.step in (None, 1) for p in parts):
        raise ValueError(f"a GGUF weight is sliced by up to two unit-step slices, got {index!r}")
    rows, cols = (*parts, slice(None))[:2]
    return rows, cols


def _float16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    pairs = blocks[..., offset : offset + 2].contiguous()
    return pairs.view(torch.float16).squeeze(-1).float()


def from_blocks(qtype: str, data: np.ndarray, shape: tuple[int, int]) -> GGUFWeight:
    """The weight of `shape` [N, K] from the file's raw bytes (uint8, N rows of blocks)."""
    if qtype not in PACKED_TYPES:
        raise ValueError(f"GGUF type {qtype} is not kept quantized; types: {PACKED_TYPES}")
    rows, cols = shape
    if cols % BLOCK:
        raise ValueError(f"a {qtype} tensor needs a multiple of {BLOCK} columns, got {cols}")
    expected = rows * (cols // BLOCK) * BLOCK_BYTES[qtype]
    if data.size != expected:
        raise ValueError(f"{qtype} tensor {shape}: {data.size} bytes, expected {expected}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the file stays read-only
    return GGUFWeight(qtype, raw.reshape(rows, cols // BLOCK, BLOCK_BYTES[qtype]))
