"""The model's small ops in one native call each on the CPU (`native/cpu_ops.c`, built and loaded
by `attnserve.native.build`): RMSNorm with or without the residual add, rotary embedding of q
and k, and SiLU-and-mul, for float32 tensors. The model's ops (`ops`) call them for float32 CPU
tensors where the library loads (`ops.use_native`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from attnserve.native.build import load_native
from attnserve.native.calls import NativeFunction


@dataclass(frozen=True)
class CpuOps:
    rms_norm: NativeFunction
    rotary_embedding: NativeFunction
    silu_and_mul: NativeFunction


@functools.cache
def cpu_ops_library() -> CpuOps | None:
    """The built ops with their signatures, or None where they cannot run here."""
    library = load_native("cpu_ops.c")
    if library is None:
        return None
    pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    threads = ctypes.c_int
    library.rms_norm.argtypes = [pointer, size, size, pointer, size, pointer, real, size, size,
                                 pointer, pointer, threads]  # fmt: skip
    library.rotary_embedding.argtypes = [pointer, size, pointer, size, size, pointer, size, size,
                                         pointer, size, size, size, pointer, pointer, pointer,
                                         pointer, threads]  # fmt: skip
    library.silu_and_mul.argtypes = [pointer, size, size, size, pointer, threads]
    names = ("rms_norm", "rotary_embedding", "silu_and_mul")
    for name in names:
        getattr(library, name).restype = None
    return CpuOps(*(NativeFunction(library, name) for name in names))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [..., N] as rows [R, N] with a unit inner stride (a view where one exists; `x`
    itself where it is such rows already: a decode step's ops are a few microseconds each)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _shaped(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` rows viewed as `shape` (no view where they have it already)."""
    return out if out.shape == shape else out.view(shape)


def _library() -> CpuOps:
    library = cpu_ops_library()
    if library is None:
        raise RuntimeError("the native CPU ops are not available here (cpu_ops_library)")
    return library


def _row_groups(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(source, group, stride): `x`'s rows of its last dimension as groups of `group` adjacent
    rows, groups `stride` floats apart. Heads [T, H, D] of strided token rows (Qwen3's q/k, a
    split of the qkv output) are groups of H with no copy; anything else is rows (group 1)."""
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x, x.shape[1], x.stride(0)
    rows = _rows(x)
    return rows, 1, rows.stride(0)


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        source, group, stride = _row_groups(x)
    else:
        source = _rows(x)
        group, stride = 1, source.stride(0)
    shape = (x.numel() // x.shape[-1], x.shape[-1])
    out = torch.empty(shape, dtype=torch.float32)
    summed = out if residual is None else torch.empty(shape, dtype=torch.float32)
    residual_rows = source if residual is None else _rows(residual)
    _library().rms_norm(
        source.data_ptr(), stride, group,
        None if residual is None else residual_rows.data_ptr(), residual_rows.stride(0),
        weight.contiguous().data_ptr(), eps, shape[0], shape[1], out.data_ptr(),
        summed.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return _shaped(out, x.shape), _shaped(summed, x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm.forward`: weight * x / sqrt(mean(x^2) + eps), a new tensor of x's shape."""
    return _launch_rms_norm(x, weight, eps, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RMSNorm.forward_with_residual`: (normed x + residual, x + residual), new tensors."""
    return _launch_rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RotaryEmbedding.forward`: new contiguous (q [T, Hq*D], k [T, Hkv*D])."""
    q, k, _ = _rotary(positions, (query, key, None), cos_sin_cache, head_size)
    return q, k


def rotary_embedding_qkv(
    positions: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`RotaryEmbedding.forward_qkv` without head norms: q and k rotated, v copied, all three
    new contiguous rows, in one call."""
    q, k, v = _rotary(positions, qkv, cos_sin_cache, head_size)
    if v is None:
        raise RuntimeError("the rotary kernel returned no value rows")
    return q, k, v


def _rotary(
    positions: torch.Tensor,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    q, k = _rows(qkv[0].flatten(1)), _rows(qkv[1].flatten(1))
    v = None if qkv[2] is None else _rows(qkv[2].flatten(1))
    q_out, k_out = torch.empty(q.shape), torch.empty(k.shape)
    v_out = None if v is None else torch.empty(v.shape)
    positions = positions.to(torch.int64).contiguous()
    _library().rotary_embedding(
        positions.data_ptr(), q.shape[0], q.data_ptr(), q.stride(0), q.shape[1] // head_size,
        k.data_ptr(), k.stride(0), k.shape[1] // head_size,
        None if v is None else v.data_ptr(), 0 if v is None else v.stride(0),
        0 if v is None else v.shape[1], head_size, cos_sin_cache.contiguous().data_ptr(),
        q_out.data_ptr(), k_out.data_ptr(), None if v_out is None else v_out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out, v_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] [..., 2*I] -> silu(gate) * up [..., I]."""
    rows = _rows(x)
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter)
    _library().silu_and_mul(rows.data_ptr(), rows.stride(0), rows.shape[0], inter, out.data_ptr(),
                            torch.get_num_threads())  # fmt: skip
    return _shaped(out, (*x.shape[:-1], inter))
