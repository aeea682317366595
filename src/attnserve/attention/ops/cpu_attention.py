"""The native paged-attention kernel of `native/cpu_attention.c` (built and
loaded by `attnserve.native.build`), called on torch tensors' memory."""

from __future__ import annotations

import ctypes
import functools

import torch

from attnserve.native.build import load_native
from attnserve.native.calls import NativeFunction


@functools.cache
def cpu_attention_library() -> NativeFunction | None:
    """The built kernel with its signature, or None where it cannot run here."""
    library = load_native("cpu_attention.c")
    if library is None:
        return None
    pointer, size, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    library.cpu_paged_attention.argtypes = [
        *(pointer, size) * 3,  # q, k, v and their row strides
        pointer, pointer,  # k_cache, v_cache
        pointer, pointer, pointer, pointer,  # slot_mapping, token_seq, token_pos, block_table
        size, size, size, size, size, size,  # table width, block size, T, H, Hkv, D
        real, size, real, pointer,  # scale, window, soft-cap, ALiBi slopes
        pointer, ctypes.c_int,  # out, threads
    ]  # fmt: skip
    return NativeFunction(library, "cpu_paged_attention")


def _rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """`x` [T, width] float32 with a unit inner stride (a copy only when it lacks one), and its
    row stride in floats."""
    if x.dim() != 2 or x.shape[1] != width:
        x = x.reshape(x.shape[0], width)
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.to(torch.float32).contiguous()
    return x, x.stride(0)


def cpu_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    shape: tuple[int, int, int],
    scale: float,
    window: int | None,
    soft_cap: float | None,
    alibi: torch.Tensor | None,
) -> torch.Tensor:
    """One layer's attention (see the C source). `tables`: slot_mapping, token_seq, token_pos
    [T] and block_table [B, W], contiguous int64; `shape`: heads, KV heads, head size;
    kv_cache [2, blocks, block size, Hkv, D] float32. Returns [T, H*D], computed on torch's
    thread count."""
    kernel = cpu_attention_library()
    if kernel is None:
        raise RuntimeError("the native CPU attention kernel is not available here")
    heads, kv_heads, head_size = shape
    slot_mapping, token_seq, token_pos, block_table = tables
    q, q_stride = _rows(query, heads * head_size)
    k, k_stride = _rows(key, kv_heads * head_size)
    v, v_stride = _rows(value, kv_heads * head_size)
    out = torch.empty(q.shape[0], heads * head_size, dtype=torch.float32)
    failed = kernel(
        q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride,
        kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.stride(0) * kv_cache.element_size(),
        slot_mapping.data_ptr(), token_seq.data_ptr(), token_pos.data_ptr(),
        block_table.data_ptr(), block_table.shape[1], kv_cache.shape[2], q.shape[0],
        heads, kv_heads, head_size, scale, window or 0, soft_cap or 0.0,
        None if alibi is None else alibi.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("cpu_paged_attention: out of memory for the score buffers")
    return out
