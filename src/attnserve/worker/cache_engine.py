"""`CacheEngine`: the KV cache tensors, shaped and moved only through the backend.

One tensor per attention layer, or, for a model of several KV-cache groups, one per place in a
group (`attention.kv_cache_groups`: the i-th layer of every group shares the i-th tensor).

The number of blocks comes from a memory budget: `kv_cache_memory_bytes` on the CPU, or a
fraction (`gpu_memory_utilization`) of the GPU's memory less what is already in use.
"""

from __future__ import annotations

import math

import torch

from attnserve.attention.abstract import AttentionBackend


class CacheEngine:
    def __init__(
        self,
        backend: type[AttentionBackend],
        num_tensors: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        num_swap_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.backend = backend
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        cache_dtype = backend.get_kv_cache_torch_dtype(kv_cache_dtype, dtype)

        def allocate(blocks: int, where: torch.device | str) -> list[torch.Tensor]:
            shape = backend.get_kv_cache_shape(blocks, block_size, num_kv_heads, head_size)
            return [torch.zeros(shape, dtype=cache_dtype, device=where) for _ in range(num_tensors)]

        self.kv_caches = allocate(num_blocks, device)
        self.swap_caches = allocate(num_swap_blocks, "cpu") if num_swap_blocks else []

    @staticmethod
    def bytes_per_block(
        backend: type[AttentionBackend],
        num_tensors: int,
        num_kv_heads: int,
        head_size: int,
        block_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """Bytes one block takes across all cache tensors, from the backend's own shape."""
        shape = backend.get_kv_cache_shape(1, block_size, num_kv_heads, head_size)
        element = backend.get_kv_cache_torch_dtype(kv_cache_dtype, dtype).itemsize
        return num_tensors * math.prod(shape) * element

    def swap_out(self, device_to_host: torch.Tensor) -> None:
        """Copy device blocks [:, 0] to swap blocks [:, 1], tensor by tensor."""
        for src, dst in zip(self.kv_caches, self.swap_caches, strict=True):
            self.backend.swap_blocks(src, dst, device_to_host)

    def swap_in(self, host_to_device: torch.Tensor) -> None:
        """Copy swap blocks [:, 0] back to device blocks [:, 1], tensor by tensor."""
        for src, dst in zip(self.swap_caches, self.kv_caches, strict=True):
            self.backend.swap_blocks(src, dst, host_to_device)

    def copy(self, src_to_dsts: torch.Tensor) -> None:
        """Copy device blocks [:, 0] onto device blocks [:, 1] in every tensor."""
        self.backend.copy_blocks(self.kv_caches, src_to_dsts)


def gpu_kv_cache_budget(gpu_memory_utilization: float, device: torch.device) -> int:
    """Bytes left for the KV cache: the utilisation share of the card less what is in use now."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = torch.cuda.mem_get_info(device)
    return int(total * gpu_memory_utilization) - (total - free)


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """How many blocks fit in `budget_bytes`; ValueError when not even one does."""
    blocks = budget_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_memory_bytes / gpu_memory_utilization or shrink the model"
        )
    return int(blocks)
