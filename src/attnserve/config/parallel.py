"""`ParallelConfig`: tensor- and data-parallel sizes and how the ranks are started."""

from __future__ import annotations

from dataclasses import dataclass

DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size ranks each hold a shard of the model and run every step together;
    distributed_executor_backend says how the ranks are started: "uni" (one rank, in the engine
    process), "mp" (one process per rank on this host) or "ray" (one Ray actor per rank, across
    the hosts of a Ray cluster). None picks "uni" for one rank, else "mp". data_parallel_size
    engine cores, each with its own tensor_parallel_size ranks, share one front end."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
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
