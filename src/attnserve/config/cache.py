"""Engine configuration: the KV cache, the scheduler, the parallel layout and speculative
decoding, frozen and validated up front."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

KV_CACHE_DTYPES = ("auto", "fp8")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's: arrival order, or (priority, arrival)
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


LONG_PREFILL_FRACTION = 0.04  # of max_model_len: vLLM's default long-prefill threshold


@dataclass(frozen=True)
class SchedulerConfig:
    """Per step at most max_num_seqs sequences and max_num_batched_tokens new tokens; when the
    KV cache runs out, sequences are preempted by "recompute" or "swap". With async_scheduling
    the engine schedules the next step while the device runs the current one."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = True
    long_prefill_token_threshold: int = 0  # 0: 4% of max_model_len (vLLM's value)
    max_long_partial_prefills: int = 1

    @property
    def long_prefill_tokens(self) -> int:
        """A prompt with more tokens than this left to compute is long (the scheduler's
        docstring says how long prompts share the budget)."""
        if self.long_prefill_token_threshold:
            return self.long_prefill_token_threshold
        return max(1, int(self.max_model_len * LONG_PREFILL_FRACTION))

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: 4% of max_model_len), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.max_long_partial_prefills < 1:
            raise ValueError(
                f"max_long_partial_prefills must be >= 1, got {self.max_long_partial_prefills}"
            )


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


SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): before each step of a small batch,
    up to num_speculative_tokens draft tokens per decoding sequence, verified in one forward
    pass. method "ngram" drafts by prompt lookup: the tokens that followed an earlier
    occurrence of the sequence's last prompt_lookup_max..prompt_lookup_min tokens (each
    defaults to the other, both to 5); method "draft_model" drafts with `model` (a smaller
    model of the same vocabulary, greedily, with a KV cache of its own). Speculation steps
    aside while more than disable_by_batch_size sequences run (a large batch is compute-bound:
    drafts would cost more than they save; those steps also keep async scheduling, which
    speculation turns off)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model of method "draft_model"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            _check_speculative_int(name, getattr(self, name))
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model: method 'draft_model' needs a draft model, and only it "
                f"takes one (method {self.method!r}, model {self.model!r})"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """The config of a `speculative_config` dict (as vLLM takes it); every key must be one
        this engine serves."""
        if not isinstance(values, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        given = dict(values)
        if "model" in given:  # vLLM's rule: a draft model's method is "draft_model"
            given.setdefault("method", "draft_model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        if "num_speculative_tokens" not in given:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if given.get("method") == "draft_model":
            for name in NGRAM_FIELDS:
                if name in given:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram' only")
        lookup_max, lookup_min = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if value is not None:  # checked before one stands in for the other
                _check_speculative_int(name, value)
        if lookup_max is None:
            lookup_max = DEFAULT_PROMPT_LOOKUP if lookup_min is None else lookup_min
        given["prompt_lookup_max"] = lookup_max
        given["prompt_lookup_min"] = lookup_max if lookup_min is None else lookup_min
        return cls(**given)


def _check_speculative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
