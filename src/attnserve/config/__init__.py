"""Every config of attnserve in one place, frozen and validated up front (a ValueError naming
the field): the cache, scheduler, parallel, speculative and structured-output configs, the
`EngineConfig` that bundles them with the model's, the `EngineArgs` that build it (shared by
`LLM`, the CLI and the server) and the server's own `FrontendArgs`; both argument classes turn
into command-line flags through `cli_args`. `KVCacheInfo` is what the ranks allocated."""

from attnserve.config.cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KV_CACHE_DTYPES,
    CacheConfig,
    KVCacheInfo,
)
from attnserve.config.engine import EngineConfig
from attnserve.config.engine_args import EngineArgs
from attnserve.config.frontend import FrontendArgs
from attnserve.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig
from attnserve.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from attnserve.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from attnserve.config.structured_outputs import StructuredOutputsConfig

__all__ = [
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "DISTRIBUTED_EXECUTOR_BACKENDS",
    "KV_CACHE_DTYPES",
    "PREEMPTION_MODES",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "FrontendArgs",
    "KVCacheInfo",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]
