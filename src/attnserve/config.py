"""Engine configuration: the KV cache, the scheduler and the parallel layout, frozen and
validated up front."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8")
PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """block_size tokens per block; the KV budget is kv_cache_memory_bytes when given (and on
    CPU, where it defaults to 1 GiB), else gpu_memory_utilization of the GPU. swap_space_bytes of
    host memory hold swapped-out blocks (used with preemption_mode="swap")."""

    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space_bytes: int = 0

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
class SchedulerConfig:
    """Per step at most max_num_seqs sequences and max_num_batched_tokens new tokens; when the
    KV cache runs out, sequences are preempted by "recompute" or "swap". With async_scheduling
    the engine schedules the next step while the device runs the current one."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    preemption_mode: str = "recompute"
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size ranks each hold a shard of the model and run every step together;
    distributed_executor_backend says how the ranks are started: "uni" (one rank, in the engine
    process), "mp" (one process per rank on this host) or "ray" (one Ray actor per rank, across
    the hosts of a Ray cluster). None picks "uni" for one rank, else "mp"."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed_executor_backend {backend!r}; "
                f"use one of {DISTRIBUTED_EXECUTOR_BACKENDS}"
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one rank; use 'mp' or 'ray' for "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"
