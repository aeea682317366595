"""Tensor parallelism through `torch.distributed`: the process groups and their collectives."""

from attnserve.distributed.communication import (
    broadcast_object,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from attnserve.distributed.parallel_state import (
    destroy_distributed_environment,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    init_distributed_environment,
    model_parallel_is_initialized,
)
from attnserve.distributed.utils import divide, get_distributed_init_method, get_open_port

__all__ = [
    "broadcast_object",
    "destroy_distributed_environment",
    "divide",
    "get_distributed_init_method",
    "get_open_port",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "init_distributed_environment",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
