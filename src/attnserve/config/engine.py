"""`EngineConfig`: the one frozen, picklable config of an engine, bundling the model, cache,
scheduler and parallel configs with the engine-wide settings (vLLM's `VllmConfig`).

`EngineArgs.create_engine_config()` builds and validates it; the engine, the executor and every
rank's `Worker` receive this same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnserve.config.cache import CacheConfig
from attnserve.config.parallel import ParallelConfig
from attnserve.config.scheduler import SchedulerConfig
from attnserve.config.speculative import SpeculativeConfig
from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.lora.config import LoRAConfig
from attnserve.model.config import ModelConfig


@dataclass(frozen=True)
class EngineConfig:
    """`device` is the engine's (each rank derives its own from it); `attention_backend` None
    lets the selector choose; `enforce_eager` turns CUDA graphs off; `speculative_config` None:
    no speculative decoding; `structured_outputs_config`: the grammar caches' and compiles'
    limits."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: torch.device
    attention_backend: str | None = None
    seed: int = 0
    enforce_eager: bool = False
    speculative_config: SpeculativeConfig | None = None
    draft_model_config: ModelConfig | None = None  # speculative_config.model's
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    lora_config: LoRAConfig | None = None  # None: LoRA off
