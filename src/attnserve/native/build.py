"""The loader of the native CPU kernels: the package's C sources built once per machine with
the system C compiler, to be called through ctypes on torch tensors' memory.

A library is built into `<cache>/kernels/` ($ATTNSERVE_CACHE_DIR or ~/.cache/attnserve), keyed by
its source, flags and compiler, written whole or not at all (a staging file renamed into place).
The kernels use AVX2/FMA/F16C; those of `AVX512_SOURCES` AVX-512 too, built only where torch's
CPU capability is AVX512. They share one thread pool (`native_pool.c`, a library of its own
that every kernel library is linked against, so one set of workers serves them all); a kernel
takes its thread count as an argument (callers pass `torch.get_num_threads()`). Only OpenMP's
`simd` pragmas are on (-fopenmp-simd: no OpenMP runtime). The shared headers (`native_*.h`:
the pool's, vector math; `gguf_rows.h`) are part of every library's key. Where they cannot run
(torch's CPU capability below AVX2 or what the source needs, no compiler, a failed build),
`load_native` returns None, logging why once, and the callers take their torch path.
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

logger = logging.getLogger(__name__)

CACHE_ENV = "ATTNSERVE_CACHE_DIR"
SOURCES = Path(__file__).parent  # the C sources and headers (this package)
POOL_SOURCE = SOURCES / "native_pool.c"
HEADERS = tuple(
    SOURCES / name for name in ("native_pool.h", "native_math.h", "native_packed.h", "gguf_rows.h")
)
ISA = ("-mavx2", "-mfma", "-mf16c")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp-simd", "-shared", "-fPIC")
# sources built for AVX-512 as well, with the torch CPU capability they need (their callers
# check the rest at run time: gguf_avx512.c's VNNI)
AVX512_SOURCES = {"gguf_avx512.c": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")}
_CAPABLE = ("AVX2", "AVX512")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $ATTNSERVE_CACHE_DIR, else ~/.cache/attnserve."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnserve")


@functools.cache
def load_native(name: str) -> ctypes.CDLL | None:
    """The built library of the package's C source `name` ("cpu_ops.c"), or None where it
    cannot run here (see the module)."""
    source = SOURCES / name
    if not source.is_file():
        raise ValueError(f"no native source {name!r} in {SOURCES}")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in (("AVX512",) if name in AVX512_SOURCES else _CAPABLE):
        logger.info("native kernels of %s off: CPU capability %s", source.name, capability)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc")
    if compiler is None:
        logger.warning("native kernels of %s off: no C compiler (set CC)", source.name)
        return None
    try:
        pool = _built(POOL_SOURCE, compiler, ()).resolve()
        return ctypes.CDLL(str(_built(source, compiler, (str(pool),))))
    except subprocess.CalledProcessError as error:
        logger.warning("native kernels of %s off: %s", source.name, error.stderr[-2000:])
    except OSError as error:
        logger.warning("native kernels of %s off: %s", source.name, error)
    return None


def _built(source: Path, compiler: str, libraries: tuple[str, ...]) -> Path:
    """The shared library in the cache, compiled first if it is not there yet; linked against
    `libraries` (paths of built ones: their names hold their sources' digests)."""
    include = ("-I", str(SOURCES))
    flags = (*FLAGS, *ISA, *AVX512_SOURCES.get(source.name, ()))
    headers = b"".join(header.read_bytes() for header in HEADERS)
    key = source.read_bytes() + headers + " ".join((compiler, *flags, *libraries)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        command = [compiler, *flags, *include, str(source), *libraries, "-o", staging, "-lm",
                   "-lpthread"]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target
