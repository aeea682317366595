"""`Worker`: one tensor-parallel rank — its device, its place in the process group, its
`ModelRunner` — and the step protocol between the ranks. Every rank receives the engine's one
`EngineConfig`.

The worker sets its model runner up phase by phase (`load_model`). The driver (rank 0)
broadcasts each step's `StepPlan` (only what changed since the last one) once over the CPU group
and runs it; every other rank sits in `execute_model_loop`, applying each plan it receives to
its own persistent batch and running it, until the driver broadcasts None. All ranks sample (the
logits are all-gathered, the draws the same on every rank), so each rank's batch knows the tokens
its next step reads; only the driver's results are returned.
"""

from __future__ import annotations

import logging

import torch

from attnserve.distributed import (
    broadcast_object,
    destroy_distributed_environment,
    init_distributed_environment,
)
from attnserve.engine_config import EngineConfig
from attnserve.step_types import StepPlan, StepResults
from attnserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        device: torch.device,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.distributed_init_method = distributed_init_method
        self.model_runner: ModelRunner | None = None

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the worker has no model yet (load_model)")
        return self.model_runner

    def init_device(self) -> None:
        """Join the tensor-parallel group (when there is more than one rank) and seed."""
        world_size = self.config.parallel_config.world_size
        if world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("more than one rank needs a distributed_init_method")
            if self.device.type == "cpu" and self.rank > 0:
                torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
            init_distributed_environment(
                world_size,
                self.rank,
                self.distributed_init_method,
                self.device.index or 0,
                self.device.type,
            )
        torch.manual_seed(self.config.seed)

    def load_model(self) -> None:
        """Build this rank's model shard and KV cache (the ranks agree on the block count), in
        phases: load, size the activations, allocate the cache, calibrate, warm up, capture."""
        config = self.config
        runner = ModelRunner(config, self.device)
        runner.load_model()
        runner.initialize_kv_cache(runner.profile_activation_memory())
        runner.calibrate_kv_scales()
        runner.warm_up()
        # Captured graphs would hold the ranks' collectives; tensor parallelism runs eagerly.
        if not config.enforce_eager and config.parallel_config.world_size == 1:
            runner.capture_graphs()
        self.model_runner = runner

    def execute_model(self, plan: StepPlan) -> StepResults:
        """On the driver: send the step to the other ranks, then run it here."""
        broadcast_object(plan)
        return self.runner.execute(plan)

    def execute_model_loop(self) -> None:
        """On the other ranks: run every step the driver sends, until it sends None."""
        while True:
            plan: StepPlan | None = broadcast_object()
            if plan is None:
                return
            self.runner.execute(plan)

    def stop_remote_loops(self) -> None:
        """On the driver: end the other ranks' `execute_model_loop`."""
        broadcast_object(None)

    def shutdown(self) -> None:
        self.model_runner = None
        destroy_distributed_environment()
