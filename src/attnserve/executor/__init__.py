"""Executors: how the engine starts, feeds and stops the ranks that run the model."""

from __future__ import annotations

from attnserve.config import ParallelConfig
from attnserve.executor.executor_base import ExecutorBase


def get_executor_class(parallel_config: ParallelConfig) -> type[ExecutorBase]:
    """The executor of `parallel_config.executor_backend` ("uni", "mp" or "ray")."""
    backend = parallel_config.executor_backend
    if backend == "ray":
        from attnserve.executor.ray_executor import RayExecutor

        return RayExecutor
    if backend == "mp":
        from attnserve.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from attnserve.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


__all__ = ["ExecutorBase", "get_executor_class"]
