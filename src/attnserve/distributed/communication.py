"""Collectives of the tensor-parallel group; each is a no-op (or identity) on one rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from attnserve.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    get_tp_cpu_group,
)


def tensor_model_parallel_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over the ranks (in place)."""
    if get_tensor_model_parallel_world_size() == 1:
        return tensor
    dist.all_reduce(tensor)
    return tensor


def tensor_model_parallel_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `tensor`, concatenated along `dim` in rank order."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_all_reduce_min(value: int) -> int:
    """The smallest of each rank's `value` (on the CPU group)."""
    if get_tensor_model_parallel_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=get_tp_cpu_group())
    return int(tensor.item())


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank: pickled once, sent over the CPU group."""
    if get_tensor_model_parallel_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=get_tp_cpu_group())
    return holder[0]
