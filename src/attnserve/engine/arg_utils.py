"""`EngineArgs`: every engine knob in one frozen dataclass, shared by `LLM`, the CLI and the server.

`create_configs()` validates everything up front and resolves the model, so a bad argument fails
before any weight is loaded, with a ValueError naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.config import CacheConfig, ParallelConfig, SchedulerConfig
from attnserve.model.config import ModelConfig

_CLI_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str | None = None
    load_format: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 1 << 30
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        return torch.device(self.device)

    def create_configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig]:
        device = self.resolved_device()
        parallel_config = self.create_parallel_config(device)
        model_config = ModelConfig.resolve(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            load_format=self.load_format,
            max_model_len=self.max_model_len,
            device=device.type,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space_bytes=self.swap_space_bytes if self.preemption_mode == "swap" else 0,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            preemption_mode=self.preemption_mode,
        )
        model_config.verify_with_parallel_config(parallel_config.tensor_parallel_size)
        return model_config, cache_config, scheduler_config, parallel_config

    def create_parallel_config(self, device: torch.device) -> ParallelConfig:
        config = ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        tp = config.tensor_parallel_size
        if tp > 1 and device.type == "cuda":
            if device.index is not None:
                raise ValueError(
                    f"device {str(device)!r} names one GPU; tensor_parallel_size {tp} takes "
                    "GPUs 0..N-1 of each host: use device 'cuda'"
                )
            available = torch.cuda.device_count()
            if config.executor_backend == "mp" and tp > available:
                raise ValueError(
                    f"tensor_parallel_size {tp} needs {tp} GPUs; this host has {available}"
                )
        if config.executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs ray: pip install ray")
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
        """One `--flag-name` per field; `model` is positional (optional) or `--model`."""
        model_help = "HF model dir, .gguf file or dummy preset (default: the embedded model)"
        if positional_model:
            parser.add_argument("model", nargs="?", default=None, help=model_help)
        else:
            parser.add_argument("--model", default=None, help=model_help)
        for f in dataclasses.fields(EngineArgs):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                kind = _CLI_TYPES[str(f.type).split(" ")[0]]
                parser.add_argument(flag, type=kind, default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
