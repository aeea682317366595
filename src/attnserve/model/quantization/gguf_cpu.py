"""The native GGUF kernels of `native/gguf_cpu.c` (built and loaded by `attnserve.native.build`),
bound to torch tensors: where they cannot run, `native_library()` is None and the packed GGUF
layers use torch's int4 kernel instead (`gguf_torch`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.model.quantization.gguf_blocks import CODES_AT, GGUFWeight
from attnserve.native.build import load_native
from attnserve.native.graph import NativeFunction

TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}


@dataclass(frozen=True)
class GGUFKernels:
    mm: NativeFunction
    dequantize: NativeFunction


@functools.cache
def native_library() -> GGUFKernels | None:
    """The built kernels with their signatures, or None where they cannot run here."""
    library = load_native("gguf_cpu.c")
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    weight: list[Any] = [ctypes.c_int, pointer, pointer, pointer]  # type, codes, d, c
    threads = ctypes.c_int
    library.gguf_mm.argtypes = [*weight, size, size, pointer, size, pointer, threads]
    library.gguf_dequantize.argtypes = [*weight, size, size, pointer, size, pointer, threads]
    return GGUFKernels(
        NativeFunction(library, "gguf_mm"), NativeFunction(library, "gguf_dequantize")
    )


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at `offset` of every block, as int16 bits [N, G padded to a multiple of 8
    with zeros], contiguous (the kernels load eight blocks' scales at once)."""
    bits = blocks[..., offset : offset + 2].contiguous().view(torch.int16).squeeze(-1)
    return torch.nn.functional.pad(bits, (0, -bits.shape[1] % 8))


class NativeWeight:
    """A GGUF weight [N, K] repacked for the native kernels (the same bytes, split into codes,
    d and c arrays: see gguf_cpu.c), with each call's constants worked out once (a decode step
    makes hundreds of calls)."""

    def __init__(self, weight: GGUFWeight) -> None:
        library = native_library()
        if library is None:
            raise RuntimeError("the native GGUF kernels are not available here")
        blocks = weight.blocks
        if blocks.device.type != "cpu":
            raise ValueError("the native GGUF kernels take CPU blocks")
        self.qtype = weight.qtype
        self.rows, self.cols = weight.shape
        self.codes = blocks[..., CODES_AT[weight.qtype] :].contiguous()
        self.d = _halves(blocks, 0)
        # m of Q4_1 (the others have none: a pointer never read)
        self.c = _halves(blocks, 2) if weight.qtype == "Q4_1" else self.d
        self._mm, self._dequantize = library.mm, library.dequantize
        self._type = TYPE_IDS[weight.qtype]
        self._weight = self._pointers(0)  # the arguments of every call on the whole weight

    def _pointers(self, first_row: int) -> tuple[int, int, int, int]:
        codes, d, c = self.codes[first_row:], self.d[first_row:], self.c[first_row:]
        return self._type, codes.data_ptr(), d.data_ptr(), c.data_ptr()

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) times the weight transposed: float32 [M, N], on torch's
        thread count."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x {tuple(x.shape)} does not match the weight {self.shape}")
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        if self._mm(*self._weight, self.rows, self.cols, x.data_ptr(), x.shape[0],
                    out.data_ptr(), torch.get_num_threads()):  # fmt: skip
            raise MemoryError("gguf_mm: out of memory for the rounded activations")
        return out

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` [R] of the weight [R, K] (rounded as gguf.quants rounds them)."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.cols, dtype=torch.float32)
        if self._dequantize(*self._weight, self.rows, self.cols, ids.data_ptr(), ids.numel(),
                            out.data_ptr(), torch.get_num_threads()):  # fmt: skip
            raise ValueError(f"row ids outside 0..{self.rows - 1}")
        return out

    def dequantize_into(self, first_row: int, out: torch.Tensor) -> torch.Tensor:
        """Float32 rows first_row.. of the weight into `out` (contiguous [R, K] float32)."""
        if out.shape[1] != self.cols or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous float32 rows of {self.shape}")
        if first_row + out.shape[0] > self.rows:
            raise ValueError(f"rows {first_row}..{first_row + out.shape[0] - 1} of {self.rows}")
        self._dequantize(*self._pointers(first_row), self.rows - first_row, self.cols, None,
                         out.shape[0], out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_into(0, torch.empty(self.rows, self.cols, dtype=torch.float32))


def native_mm(x: torch.Tensor, weight: GGUFWeight) -> torch.Tensor:
    """x [M, K] times `weight` [N, K] transposed, float32 [M, N] (see `NativeWeight.mm`)."""
    return NativeWeight(weight).mm(x)


def native_dequantize(weight: GGUFWeight) -> torch.Tensor:
    """The float32 weight [N, K], rounded as `gguf.quants.dequantize` rounds it."""
    return NativeWeight(weight).dequantize()
