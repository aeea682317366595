"""`ExecutorBase`: what the engine sees of the ranks that run the model.

The engine builds one from its `EngineConfig`, reads the KV cache every rank agreed on
(`kv_cache_info`, as rank 0's worker answered it once loaded), hands it one `StepPlan` per step
and gets the driver's sampled tokens back. A step with constrained draws goes down without its
token bitmask (`launch_forward`), which follows once the engine has computed it: one rank in
this process runs the forward pass meanwhile; ranks that take only complete plans run the whole
step when the bitmask arrives. How the ranks are started
and fed (in-process, local processes, Ray actors) is the concrete executor's business. The
engine reaches the ranks only through here; what benchmarks and tests need from rank 0 itself
(its device, backend, model) they take from `driver_runner`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from attnserve.config.cache import KVCacheInfo
from attnserve.config.engine import EngineConfig
from attnserve.step_types import AsyncStepOutput, LaunchedForward, StepPlan, StepResults
from attnserve.worker.model_runner import ModelRunner
from attnserve.worker.step_future import DeferredStep, StepFuture


class ExecutorBase(ABC):
    kv_cache_info: KVCacheInfo  # what the ranks allocated, as rank 0's worker answered

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device

    @abstractmethod
    def execute_model(self, plan: StepPlan) -> StepResults:
        """Run one step on every rank; each sequence's draws (None where nothing is drawn)."""

    def execute_model_async(self, plan: StepPlan) -> AsyncStepOutput:
        """Launch one step; its draws come back through the future (by default at once)."""
        return StepFuture(len(plan.seq_ids), ready=self.execute_model(plan))

    def launch_forward(self, plan: StepPlan) -> LaunchedForward:
        """Launch a step whose token bitmask is still to come (`plan.token_bitmask` None): its
        draws are launched when `sample` hands the bitmask over. By default the ranks take only
        complete plans, so nothing runs before: the whole step runs then, with the bitmask."""
        return DeferredStep(plan, self.execute_model_async)

    @property
    def driver_runner(self) -> ModelRunner:
        """Rank 0's model runner, when it lives in this process (for benchmarks and tests:
        the engine itself never touches it)."""
        raise RuntimeError(f"{type(self).__name__} runs no model in the engine process")

    @abstractmethod
    def check_health(self) -> None:
        """RuntimeError when a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and free what they hold (idempotent)."""
