"""The native GGUF kernels of `gguf_cpu.c`: built once per machine with the system C compiler
into the attnserve cache (`<cache>/kernels/`, keyed by the source, flags and compiler) and
called through ctypes, with torch tensors' memory.

They need an x86-64 CPU with AVX2/FMA/F16C (torch's CPU capability AVX2 or AVX512) and a C
compiler ($CC, else cc); where either is missing, `native_library()` is None (the reason is
logged once) and the packed GGUF layers use torch's int4 kernels instead (`gguf_packed`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from attnserve.model.model_cache import cache_root
from attnserve.model.quantization.gguf_blocks import GGUFWeight

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_cpu.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
TYPE_IDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
_CAPABLE = ("AVX2", "AVX512")


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot run here (see the module docstring)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABLE:
        logger.info("GGUF native kernels off: CPU capability %s, not AVX2", capability)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc")
    if compiler is None:
        logger.warning("GGUF native kernels off: no C compiler (set CC); torch's int4 kernels run")
        return None
    try:
        library = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("GGUF native kernels off: building %s failed: %s", SOURCE.name, error)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.gguf_mm.argtypes = [ctypes.c_int, pointer, size, size, pointer, size, size, pointer]
    library.gguf_dequantize.argtypes = [ctypes.c_int, pointer, size, size, size, pointer]
    return library


def _built(compiler: str) -> Path:
    """The shared library in the cache, compiled first if it is not there yet."""
    key = SOURCE.read_bytes() + " ".join((compiler, *FLAGS)).encode()
    target = cache_root() / "kernels" / f"gguf_cpu-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        command = [compiler, *FLAGS, str(SOURCE), "-o", staging, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(staging, target)  # whole or absent, whoever builds at the same time
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _checked(weight: GGUFWeight) -> torch.Tensor:
    blocks = weight.blocks
    if blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError("the native GGUF kernels take contiguous CPU blocks")
    return blocks


def native_mm(x: torch.Tensor, weight: GGUFWeight) -> torch.Tensor:
    """x [M, K] (any float dtype) times the weight [N, K] transposed: float32 [M, N]."""
    library = native_library()
    if library is None:
        raise RuntimeError("the native GGUF kernels are not available here")
    blocks = _checked(weight)
    rows, cols = weight.shape
    x32 = x.to(torch.float32).contiguous()
    if x32.dim() != 2 or x32.shape[1] != cols:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight {weight.shape}")
    out = torch.empty(x32.shape[0], rows, dtype=torch.float32)
    library.gguf_mm(
        TYPE_IDS[weight.qtype],
        x32.data_ptr(),
        x32.shape[0],
        cols,
        blocks.data_ptr(),
        rows,
        blocks.stride(0),
        out.data_ptr(),
    )
    return out


def native_dequantize(weight: GGUFWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] (into `out` when given: contiguous float32 of that shape)."""
    library = native_library()
    if library is None:
        raise RuntimeError("the native GGUF kernels are not available here")
    blocks = _checked(weight)
    rows, cols = weight.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float32)
    if out.shape != (rows, cols) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {weight.shape}")
    library.gguf_dequantize(
        TYPE_IDS[weight.qtype], blocks.data_ptr(), rows, cols, blocks.stride(0), out.data_ptr()
    )
    return out
