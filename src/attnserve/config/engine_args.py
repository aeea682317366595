"""`EngineArgs`: every engine knob in one frozen dataclass, shared by `LLM`, the CLI and the server.

`create_engine_config()` validates everything up front and resolves the model (None: the
embedded default model), so a bad argument fails before any weight is loaded, with a ValueError
naming it. Each field carries its CLI help (`metadata["help"]`); `add_cli_args` turns every field
into a flag with that help and a parser taken from the field's type.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.config.cache import KV_CACHE_DTYPES, CacheConfig
from attnserve.config.cli_args import add_cli_args, arg, from_cli_args
from attnserve.config.devices import resolve_device
from attnserve.config.engine import EngineConfig
from attnserve.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig
from attnserve.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from attnserve.config.speculative import SpeculativeConfig
from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.lora.config import LoRAConfig
from attnserve.lora.targets import LoRATargets
from attnserve.model.config import LOAD_FORMATS, HubOptions, ModelConfig
from attnserve.model.default_model import default_model_dir
from attnserve.model.quantization.resolve import check_quantization
from attnserve.sampling_params import MAX_LOGPROBS

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
LARGE_GPU_GIB = 70
LARGE_GPU_OFFLINE_LIMITS = (1024, 16384)  # max_num_seqs, max_num_batched_tokens
LARGE_GPU_SERVER_LIMITS = (1024, 8192)
CPU_SERVER_MAX_NUM_BATCHED_TOKENS = 128  # a CPU step with a prompt chunk stays near a second


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = arg(
        None,
        "HF model directory, hub id (org/name, fetched to the hub cache), .gguf file or dummy "
        "preset (default: the embedded model)",
    )
    tokenizer: str | None = arg(
        None, "tokenizer directory, hub id or .gguf file (default: the model's)"
    )
    revision: str | None = arg(None, "the hub model's branch, tag or commit (default: main)")
    tokenizer_revision: str | None = arg(
        None, "the hub tokenizer's branch, tag or commit (default: main)"
    )
    download_dir: str | None = arg(
        None, "where hub models are kept (default: HF_HUB_CACHE, else $HF_HOME/hub)"
    )
    trust_remote_code: bool = arg(
        False, "let transformers run the model's own code (its config and tokenizer classes)"
    )
    generation_config: str = arg(
        "auto",
        "request defaults: auto (the sampling fields of the model's generation_config.json), "
        "vllm (none: the engine's) or a folder holding a generation_config.json",
    )
    dtype: str = arg(
        "auto", "auto (bfloat16 on CUDA, float32 elsewhere), float32, bfloat16 or float16"
    )
    device: str = arg("auto", "auto (CUDA when available), cpu, cuda or cuda:N")
    attention_backend: str | None = arg(
        None, "attention backend by name (default: the best that fits; see `attnserve backends`)"
    )
    load_format: str = arg(
        "auto", f"one of {', '.join(LOAD_FORMATS)} (dummy: random weights, no files read)"
    )
    quantization: str | None = arg(
        None,
        "how the weights are kept: gguf (a GGUF file's Q4_0/Q4_1/Q8_0 matrices stay packed; "
        "CPU), fp8 (FP8 E4M3 linear layers, per-channel weight and per-token activation "
        "scales; needs FP8 matmuls), none (GGUF dequantized to the dtype); default: the "
        "checkpoint's own (GGUF packed on the CPU, dequantized on CUDA; FP8 checkpoints in fp8)",
    )
    max_model_len: int | None = arg(
        None, "longest sequence, prompt and output (default: the model's max_position_embeddings)"
    )
    block_size: int = arg(16, "tokens per KV cache block")
    kv_cache_dtype: str = arg(
        "auto", f"KV cache storage: one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)"
    )
    kv_cache_memory_bytes: int | None = arg(
        None,
        "fixed KV cache budget in bytes (default: from gpu_memory_utilization on CUDA, "
        "1 GiB on CPU)",
    )
    gpu_memory_utilization: float = arg(
        0.9, "share of the GPU's memory for the weights, activations and KV cache"
    )
    max_num_seqs: int | None = arg(
        None,
        f"most sequences in one step (default {DEFAULT_MAX_NUM_SEQS}; offline runs and the "
        f"server on a GPU of {LARGE_GPU_GIB} GiB or more: {LARGE_GPU_OFFLINE_LIMITS[0]}, as vLLM)",
    )
    max_num_batched_tokens: int | None = arg(
        None,
        f"most new tokens in one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; on a GPU of "
        f"{LARGE_GPU_GIB} GiB or more: {LARGE_GPU_OFFLINE_LIMITS[1]} offline, "
        f"{LARGE_GPU_SERVER_LIMITS[1]} for the server, as vLLM; the server on the CPU: "
        f"{CPU_SERVER_MAX_NUM_BATCHED_TOKENS})",
    )
    long_prefill_token_threshold: int = arg(
        0,
        "a prompt with more tokens than this left to compute is long: short prompts start "
        "before long ones and keep the tokens they need in a step (0: max_model_len / 25, as vLLM)",
    )
    max_long_partial_prefills: int = arg(
        1, "most long prompts a step leaves part-way through their prefill"
    )
    enable_prefix_caching: bool = arg(
        True, "reuse the cached KV blocks of prompt prefixes seen before"
    )
    disable_hybrid_kv_cache_manager: bool = arg(
        False,
        "keep every KV block of a model that mixes sliding window and global layers (by "
        "default its window layers' blocks behind the window are freed)",
    )
    preemption_mode: str = arg(
        "recompute",
        f"how a full KV cache makes room: one of {', '.join(PREEMPTION_MODES)}",
    )
    scheduling_policy: str = arg(
        "fcfs",
        f"the order waiting requests start in: one of {', '.join(SCHEDULING_POLICIES)} "
        "(priority: by each request's priority, lower first, then arrival; preemption takes "
        "the lowest priority first)",
    )
    max_logprobs: int = arg(
        MAX_LOGPROBS,
        "most log-probabilities a request may ask for per token, more is refused (-1: no cap)",
    )
    swap_space_bytes: int = arg(1 << 30, "host memory for swapped-out KV blocks (swap mode)")
    seed: int = arg(0, "random seed (draws of unseeded requests, dummy weights)")
    enforce_eager: bool = arg(False, "run every step eagerly: capture no CUDA graphs")
    enable_lora: bool = arg(False, "serve LoRA adapters (PEFT saves) on top of the model")
    max_loras: int = arg(1, "LoRA adapters a step may use (slots kept on the device)")
    max_lora_rank: int = arg(16, "the largest LoRA rank served")
    max_cpu_loras: int | None = arg(
        None, "LoRA adapters kept loaded in host memory (default: max_loras)"
    )
    async_scheduling: bool = arg(
        True, "schedule the next step while the device runs this one (one rank only)"
    )
    tensor_parallel_size: int = arg(1, "ranks, each holding a shard of the model")
    distributed_executor_backend: str | None = arg(
        None,
        f"how the ranks start: one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} "
        "(default: uni for one rank, else mp)",
    )
    data_parallel_size: int = arg(
        1,
        "engine cores behind one front end, each a process of its own (on CUDA with its own "
        "tensor_parallel_size GPUs)",
    )
    speculative_config: dict[str, Any] | None = arg(  # noqa: RUF009 (the default is None)
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}',
    )
    structured_outputs_config: dict[str, Any] | None = arg(  # noqa: RUF009 (the default is None)
        None,
        'structured outputs\' limits, as JSON: {"cache_bytes": 67108864 (compiled grammars each '
        'process keeps), "max_spec_bytes": 524288 (largest spec), "compile_timeout_s": 10}',
    )
    engine_core_process: bool | None = arg(
        None,
        "run the scheduler and the model in a process of their own, apart from the front end's "
        "tokenizing, detokenizing and HTTP (default: on for serve, off for LLM, generate, chat; "
        "always on with data_parallel_size > 1)",
    )

    def resolved_device(self) -> torch.device:
        return resolve_device(self.device)

    def with_offline_defaults(self) -> EngineArgs:
        """These arguments for an offline run (`LLM`): on a GPU of LARGE_GPU_GIB or more, the
        step limits not given are vLLM's offline ones there (more sequences and tokens a step
        than a server's, whose latency they would cost)."""
        return self._with_large_gpu_limits(LARGE_GPU_OFFLINE_LIMITS)

    def with_server_defaults(self) -> EngineArgs:
        """These arguments for the server (`attnserve serve`): on a GPU of LARGE_GPU_GIB or
        more, the step limits not given are vLLM's online ones there (as many sequences as
        offline, half the tokens a step: a step that carries prompt chunks stays short); on
        the CPU, CPU_SERVER_MAX_NUM_BATCHED_TOKENS a step, for the same reason."""
        if self.resolved_device().type == "cpu":
            tokens = _given_or(self.max_num_batched_tokens, CPU_SERVER_MAX_NUM_BATCHED_TOKENS)
            return dataclasses.replace(self, max_num_batched_tokens=tokens)
        return self._with_large_gpu_limits(LARGE_GPU_SERVER_LIMITS)

    def _with_large_gpu_limits(self, limits: tuple[int, int]) -> EngineArgs:
        device = self.resolved_device()
        if device.type != "cuda":
            return self
        if torch.cuda.get_device_properties(device).total_memory < LARGE_GPU_GIB * 2**30:
            return self
        seqs, tokens = limits
        return dataclasses.replace(
            self,
            max_num_seqs=_given_or(self.max_num_seqs, seqs),
            max_num_batched_tokens=_given_or(self.max_num_batched_tokens, tokens),
        )

    def uses_core_process(self, default: bool) -> bool:
        """Whether the engine core runs in its own process(es): `engine_core_process`, or when
        unset, `default` (the entry point's) or data parallelism."""
        if self.engine_core_process is not None:
            return self.engine_core_process
        return default or self.data_parallel_size > 1

    def create_engine_config(self) -> EngineConfig:
        check_quantization(self.quantization)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= -1 (-1: no cap), got {self.max_logprobs}")
        device = self.resolved_device()
        parallel_config = self.create_parallel_config(device)
        cache_config = CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            swap_space_bytes=self.swap_space_bytes if self.preemption_mode == "swap" else 0,
            disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager,
        )
        model_config = ModelConfig.resolve(
            model=default_model_dir() if self.model is None else self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            load_format=self.load_format,
            max_model_len=self.max_model_len,
            device=device.type,
            quantization=self.quantization,
            hub=self.hub_options(),
            generation_config=self.generation_config,
        )
        model_config.verify_with_parallel_config(parallel_config.tensor_parallel_size)
        scheduler_config = SchedulerConfig(
            max_num_seqs=_given_or(self.max_num_seqs, DEFAULT_MAX_NUM_SEQS),
            max_num_batched_tokens=_given_or(
                self.max_num_batched_tokens, DEFAULT_MAX_NUM_BATCHED_TOKENS
            ),
            max_model_len=model_config.max_model_len,
            preemption_mode=self.preemption_mode,
            scheduling_policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_long_partial_prefills=self.max_long_partial_prefills,
        )
        speculative_config = (
            None
            if self.speculative_config is None
            else SpeculativeConfig.from_dict(self.speculative_config)
        )
        draft = _draft_model_config(speculative_config, model_config, device, self.hub_options())
        if draft is not None:
            try:
                draft.verify_with_parallel_config(parallel_config.tensor_parallel_size)
            except ValueError as error:
                raise ValueError(f"speculative_config.model: {error}") from None
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device=device,
            attention_backend=self.attention_backend,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            speculative_config=speculative_config,
            draft_model_config=draft,
            structured_outputs_config=StructuredOutputsConfig.from_dict(
                self.structured_outputs_config
            ),
            lora_config=self.create_lora_config(model_config),
        )

    def create_lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        """The LoRA limits with `enable_lora` (ValueError for a model LoRA does not serve)."""
        if not self.enable_lora:
            return None
        LoRATargets.of_model(model_config)
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def hub_options(self) -> HubOptions:
        return HubOptions(
            self.revision, self.tokenizer_revision, self.download_dir, self.trust_remote_code
        )

    def create_parallel_config(self, device: torch.device) -> ParallelConfig:
        config = ParallelConfig(
            self.tensor_parallel_size, self.distributed_executor_backend, self.data_parallel_size
        )
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        if dp > 1 and self.engine_core_process is False:
            raise ValueError(
                f"data_parallel_size {dp} runs each engine core in a process of its own: "
                "engine_core_process cannot be off"
            )
        if (tp > 1 or dp > 1) and device.type == "cuda":
            if device.index is not None:
                raise ValueError(
                    f"device {str(device)!r} names one GPU; tensor_parallel_size {tp} x "
                    f"data_parallel_size {dp} takes GPUs 0..N-1 of the host: use device 'cuda'"
                )
            available = torch.cuda.device_count()
            if config.executor_backend != "ray" and tp * dp > available:  # Ray ranks: anywhere
                raise ValueError(
                    f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} GPUs; "
                    f"this host has {available}"
                )
        if config.executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs ray: pip install ray")
        return config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """One `--flag-name` per field (`config.cli_args`); with `positional_model` the model
        may also be given as an optional positional MODEL (as in `vllm serve MODEL`)."""
        add_cli_args(parser, EngineArgs, positional_model)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return from_cli_args(cls, args)


def _draft_model_config(
    spec: SpeculativeConfig | None, target: ModelConfig, device: torch.device, hub: HubOptions
) -> ModelConfig | None:
    """The draft model's config (speculative_config.model), in the target's dtype and load
    format, for its max_model_len; a ValueError naming the field where it cannot serve. A hub
    id is fetched as the target's (its download dir and trust), at its main revision."""
    if spec is None or spec.model is None:
        return None
    try:
        draft = ModelConfig.resolve(
            model=spec.model,
            dtype=target.dtype,
            load_format="dummy" if target.load_format == "dummy" else "auto",
            max_model_len=target.max_model_len,
            device=device.type,
            hub=HubOptions(download_dir=hub.download_dir, trust_remote_code=hub.trust_remote_code),
        )
    except ValueError as error:
        raise ValueError(f"speculative_config.model {spec.model!r}: {error}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model {spec.model!r}: a vocabulary of {draft.vocab_size} "
            f"tokens, the target's has {target.vocab_size}: the draft must share it"
        )
    return draft


def _given_or(value: int | None, default: int) -> int:
    return default if value is None else value
