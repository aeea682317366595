"""`CacheConfig`: the KV cache the user asks for (block size, dtype, budget, prefix caching,
swap space); `KVCacheInfo`: what the ranks allocated for it."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """block_size tokens per block; the KV budget is kv_cache_memory_bytes when given (and on
    CPU, where it defaults to 1 GiB), else gpu_memory_utilization of the GPU. swap_space_bytes of
    host memory hold swapped-out blocks (used with preemption_mode="swap"). A model that mixes
    sliding-window and global layers keeps a block table per KV-cache group and frees the
    blocks its window layers have left behind, unless disable_hybrid_kv_cache_manager (then
    every layer keeps every block, as vLLM's flag of that name does)."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class KVCacheInfo:
    """What the ranks allocated, as the worker answers the executor once its cache is up:
    num_blocks KV blocks per rank (the same on every rank), num_swap_blocks host blocks for
    swapped-out sequences, and each KV-cache group's sliding window (None: the group keeps
    every block), group 0 first."""

    num_blocks: int
    num_swap_blocks: int
    windows: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if not self.windows:
            raise ValueError("windows must name at least one KV-cache group")
