"""`UniProcExecutor`: one rank, in the engine process — a plain `ModelRunner`, no copies. A step
launched before its token bitmask exists starts its forward pass at once (`launch_forward`)."""

from __future__ import annotations

from attnserve.config.engine import EngineConfig
from attnserve.distributed import model_parallel_is_initialized
from attnserve.executor.executor_base import ExecutorBase
from attnserve.step_types import AsyncStepOutput, LaunchedForward, StepPlan, StepResults
from attnserve.worker.model_runner import ModelRunner
from attnserve.worker.worker import Worker


class UniProcExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if model_parallel_is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is running in this process: shut it down before "
                "starting a single-rank one"
            )
        self.worker = Worker(config, rank=0, device=config.device)
        self.worker.init_device()
        self.kv_cache_info = self.worker.load_model()

    @property
    def driver_runner(self) -> ModelRunner:
        return self.worker.runner

    def execute_model(self, plan: StepPlan) -> StepResults:
        return self.worker.execute_model(plan)

    def execute_model_async(self, plan: StepPlan) -> AsyncStepOutput:
        return self.worker.execute_model_async(plan)

    def launch_forward(self, plan: StepPlan) -> LaunchedForward:
        return self.worker.launch_forward(plan)

    def check_health(self) -> None:
        """One rank in this process: alive as long as the engine is."""

    def shutdown(self) -> None:
        self.worker.model_runner = None
