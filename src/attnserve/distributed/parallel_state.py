"""The process groups of this process: the tensor-parallel world and its CPU (gloo) group.

attnserve has one kind of parallelism, tensor parallelism, so the TP group is the whole world.
Model collectives run on the world group (NCCL on CUDA, gloo on CPU); step inputs and other
Python objects are broadcast on a separate gloo group, whose long timeout lets workers wait for
the next step while the engine is idle. Without an initialised group every getter answers as
for one rank, so the single-process path needs no set-up.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Joining, and a model collective, fail after this (a rank is gone); but workers wait in a
# CPU-group broadcast for the next step however long the engine stays idle.
_WORLD_TIMEOUT = datetime.timedelta(minutes=10)
_CPU_GROUP_TIMEOUT = datetime.timedelta(days=365)

_WORLD_SIZE = 1
_RANK = 0
_CPU_GROUP: dist.ProcessGroup | None = None


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    local_rank: int,
    device_type: str,
) -> None:
    """Join the world of `world_size` ranks; on CUDA also bind this rank's device."""
    global _WORLD_SIZE, _RANK, _CPU_GROUP
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group already exists in this process: shut the other "
            "engine down first (one tensor-parallel engine per process)"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend,
        init_method=distributed_init_method,
        world_size=world_size,
        rank=rank,
        timeout=_WORLD_TIMEOUT,
    )
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=_CPU_GROUP_TIMEOUT)
    _WORLD_SIZE, _RANK = world_size, rank
    logger.info("rank %d of %d joined the %s group", rank, world_size, backend)


def model_parallel_is_initialized() -> bool:
    return _CPU_GROUP is not None


def get_tensor_model_parallel_world_size() -> int:
    return _WORLD_SIZE


def get_tensor_model_parallel_rank() -> int:
    return _RANK


def get_tp_cpu_group() -> dist.ProcessGroup:
    if _CPU_GROUP is None:
        raise RuntimeError("no tensor-parallel group in this process")
    return _CPU_GROUP


def destroy_distributed_environment() -> None:
    """Leave the world (no-op when this process never joined one)."""
    global _WORLD_SIZE, _RANK, _CPU_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD_SIZE, _RANK, _CPU_GROUP = 1, 0, None


def abort_distributed_environment() -> None:
    """Fail the collectives this process is blocked in (a peer died): best effort."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except (RuntimeError, ValueError) as error:
            logger.debug("process group abort failed: %s", error)
