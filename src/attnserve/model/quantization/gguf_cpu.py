"""The native GGUF kernels of `gguf_cpu.c` (built and loaded by `attnserve.native`), bound to
torch tensors: where they cannot run, `native_library()` is None and the packed GGUF layers use
torch's int4 kernel instead (`gguf_torch`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from attnserve.model.quantization.gguf_blocks import GGUFWeight
from attnserve.native import load_native

SOURCE = Path(__file__).with_name("gguf_cpu.c")
TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The built kernels with their signatures, or None where they cannot run here."""
    library = load_native(SOURCE)
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.gguf_mm.argtypes = [ctypes.c_int, pointer, size, size, pointer, size, size, pointer]
    library.gguf_dequantize.argtypes = [ctypes.c_int, pointer, size, size, size, pointer]
    return library


class NativeWeight:
    """A GGUF weight [N, K] bound to the native kernels, the call's constants worked out once
    (a decode step makes hundreds of these calls)."""

    def __init__(self, weight: GGUFWeight) -> None:
        library = native_library()
        if library is None:
            raise RuntimeError("the native GGUF kernels are not available here")
        blocks = weight.blocks
        if blocks.device.type != "cpu" or not blocks.is_contiguous():
            raise ValueError("the native GGUF kernels take contiguous CPU blocks")
        self.weight = weight
        self.rows, self.cols = weight.shape
        self._mm, self._dequantize = library.gguf_mm, library.gguf_dequantize
        self._type = TYPE_IDS[weight.qtype]
        self._blocks, self._stride = blocks.data_ptr(), blocks.stride(0)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) times the weight transposed: float32 [M, N]."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x {tuple(x.shape)} does not match the weight {self.weight.shape}")
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        failed = self._mm(
            self._type, x.data_ptr(), x.shape[0], self.cols, self._blocks, self.rows,
            self._stride, out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError("gguf_mm: out of memory for the rounded activations")
        return out

    def dequantize(self, start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 rows start.. of the weight (as many as `out` has; all without `out`)."""
        if out is None:
            out = torch.empty(self.rows - start, self.cols, dtype=torch.float32)
        if out.shape[1] != self.cols or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous float32 rows of {self.weight.shape}")
        if start + out.shape[0] > self.rows:
            raise ValueError(f"rows {start}..{start + out.shape[0] - 1} of {self.rows}")
        self._dequantize(
            self._type, self._blocks + start * self._stride, out.shape[0], self.cols,
            self._stride, out.data_ptr(),
        )  # fmt: skip
        return out


def native_mm(x: torch.Tensor, weight: GGUFWeight) -> torch.Tensor:
    """x [M, K] times `weight` [N, K] transposed, float32 [M, N] (see `NativeWeight.mm`)."""
    return NativeWeight(weight).mm(x)


def native_dequantize(weight: GGUFWeight) -> torch.Tensor:
    """The float32 weight [N, K], rounded as `gguf.quants.dequantize` rounds it."""
    return NativeWeight(weight.rows(torch.Tensor.contiguous)).dequantize()
