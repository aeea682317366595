"""The native GGUF kernels of `native/gguf_cpu.c` (AVX2) and `native/gguf_avx512.c` (AVX-512
VNNI: bit-identical results, several activation rows for little more than one), built and loaded
by `attnserve.native.build`, bound to torch tensors. A weight is repacked for the kernels it
runs on: the AVX-512 ones where this CPU has AVX512F/BW/VL/VNNI, unless $ATTNSERVE_GGUF_KERNELS
is "avx2"; else the AVX2 ones; where neither can run, `native_library()` is None and the packed
GGUF layers use torch's int4 kernel instead (`gguf_torch`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.model.quantization.gguf_blocks import CODES_AT, GGUFWeight
from attnserve.native.build import load_native
from attnserve.native.calls import NativeFunction

logger = logging.getLogger(__name__)

TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
KERNELS_ENV = "ATTNSERVE_GGUF_KERNELS"
SOURCES = {"avx2": "gguf_cpu.c", "avx512": "gguf_avx512.c"}  # each exports gguf_mm, gguf_dequantize
TILE = 16  # weight rows a tile of the AVX-512 layout (gguf_avx512.c)


@dataclass(frozen=True)
class GGUFKernels:
    isa: str  # "avx2" or "avx512": the layout of the weights they take too
    mm: NativeFunction
    dequantize: NativeFunction


@functools.cache
def kernels(isa: str) -> GGUFKernels | None:
    """The built kernels of `isa` (a key of SOURCES) with their signatures, or None where they
    cannot run here."""
    library = load_native(SOURCES[isa])
    if library is None:
        return None
    if isa == "avx512" and not library.gguf_avx512_supported():
        logger.info("AVX-512 GGUF kernels off: this CPU lacks AVX512BW, VL or VNNI")
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    weight: list[Any] = [ctypes.c_int, pointer, pointer, pointer]  # type, codes, d, c
    threads = ctypes.c_int
    library.gguf_mm.argtypes = [*weight, size, size, pointer, size, pointer, threads]
    library.gguf_dequantize.argtypes = [*weight, size, size, size, pointer, size, pointer, threads]
    return GGUFKernels(
        isa, NativeFunction(library, "gguf_mm"), NativeFunction(library, "gguf_dequantize")
    )


def native_library() -> GGUFKernels | None:
    """The kernels a weight runs on by default (see the module), or None where none can run."""
    if os.environ.get(KERNELS_ENV, "").lower() != "avx2":
        fast = kernels("avx512")
        if fast is not None:
            return fast
    return kernels("avx2")


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at `offset` of every block, as int16 bits [N, G]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.int16).squeeze(-1)


def _tiled(units: torch.Tensor) -> torch.Tensor:
    """[N, G, U, W] as gguf_avx512.c takes them: [T, G, U, TILE, W], N padded with zero rows
    to T tiles of TILE."""
    rows, groups = units.shape[:2]
    padding = units.new_zeros(-rows % TILE, *units.shape[1:])
    whole = torch.cat([units, padding]).view(-1, TILE, groups, *units.shape[2:])
    return whole.permute(0, 2, 3, 1, 4).contiguous()


def _codes(isa: str, codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, G, code bytes] as `isa`'s kernels take them: AVX2's as they are, AVX-512's
    tiled in 2-byte units."""
    if isa == "avx512":
        return _tiled(codes.reshape(*codes.shape[:2], -1, 2))
    return codes.contiguous()


def _scales(isa: str, scales: torch.Tensor) -> torch.Tensor:
    """Float16 bits [N, G] as `isa`'s kernels take them: AVX2's padded with zeros to whole
    eights of blocks (eight load at once), AVX-512's tiled."""
    if isa == "avx512":
        return _tiled(scales[..., None, None])
    return torch.nn.functional.pad(scales, (0, -scales.shape[1] % 8))


class NativeWeight:
    """A GGUF weight [N, K] repacked for the native kernels of `isa` (default: see the module;
    the same bytes, split into codes, d and c arrays: see gguf_cpu.c and gguf_avx512.c), with
    each call's constants worked out once (a decode step makes hundreds of calls)."""

    def __init__(self, weight: GGUFWeight, isa: str | None = None) -> None:
        library = native_library() if isa is None else kernels(isa)
        if library is None:
            raise RuntimeError(f"the native GGUF kernels ({isa or 'any'}) are not available here")
        blocks = weight.blocks
        if blocks.device.type != "cpu":
            raise ValueError("the native GGUF kernels take CPU blocks")
        self.qtype, self.isa = weight.qtype, library.isa
        self.rows, self.cols = weight.shape
        self.codes = _codes(self.isa, blocks[..., CODES_AT[weight.qtype] :])
        self.d = _scales(self.isa, _halves(blocks, 0))
        # m of Q4_1 (the others have none: a pointer never read)
        self.c = _scales(self.isa, _halves(blocks, 2)) if weight.qtype == "Q4_1" else self.d
        self._mm, self._dequantize = library.mm, library.dequantize
        pointers = (t.data_ptr() for t in (self.codes, self.d, self.c))
        self._weight = (TYPE_IDS[weight.qtype], *pointers)  # the arguments of every call

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
        if self._dequantize(*self._weight, self.rows, self.cols, 0, ids.data_ptr(), ids.numel(),
                            out.data_ptr(), torch.get_num_threads()):  # fmt: skip
            raise ValueError(f"row ids outside 0..{self.rows - 1}")
        return out

    def dequantize_into(self, first_row: int, out: torch.Tensor) -> torch.Tensor:
        """Float32 rows first_row.. of the weight into `out` (contiguous [R, K] float32)."""
        if out.shape[1] != self.cols or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous float32 rows of {self.shape}")
        if first_row + out.shape[0] > self.rows:
            raise ValueError(f"rows {first_row}..{first_row + out.shape[0] - 1} of {self.rows}")
        self._dequantize(*self._weight, self.rows, self.cols, first_row, None, out.shape[0],
                         out.data_ptr(), torch.get_num_threads())  # fmt: skip
        return out

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_into(0, torch.empty(self.rows, self.cols, dtype=torch.float32))
