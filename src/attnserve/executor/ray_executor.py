"""`RayExecutor` (`distributed_executor_backend="ray"`): one Ray actor per rank, across the
hosts of a Ray cluster.

A placement group reserves one bundle per rank (a GPU on CUDA, a CPU otherwise); each actor is
a `Worker` on its bundle, rank 0 (the driver) included, so the engine process needs no GPU. The
ranks join a process group on a free port of the driver actor's host. Each step the engine
sends the plan to the driver actor, which broadcasts it once to the others (waiting in their
`execute_model_loop`) and returns its sampled tokens. A dead actor fails the step; the engine
gets a RuntimeError naming the rank and every actor is killed. Ray is imported only here.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import torch

from attnserve.config.cache import KVCacheInfo
from attnserve.config.engine import EngineConfig
from attnserve.distributed import get_distributed_init_method, get_open_port
from attnserve.distributed.utils import get_ip
from attnserve.executor.executor_base import ExecutorBase
from attnserve.step_types import StepPlan, StepResults
from attnserve.worker.worker import Worker

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0


class RayWorkerWrapper:
    """The actor body: a `Worker` built once Ray has placed it (its GPU is cuda:0 here)."""

    def __init__(self, config: EngineConfig, rank: int, device_type: str) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        self.worker: Worker | None = None

    def get_address(self) -> tuple[str, int]:
        """This host's address and a free port on it (for the rank-0 actor's group)."""
        return get_ip(), get_open_port()

    def init_worker(self, init_method: str) -> KVCacheInfo:
        self.worker = Worker(self.config, self.rank, self.device, init_method)
        self.worker.init_device()
        return self.worker.load_model()

    def execute_model(self, plan: StepPlan) -> StepResults:
        return self._worker().execute_model(plan)

    def execute_model_loop(self) -> None:
        self._worker().execute_model_loop()

    def stop_remote_loops(self) -> None:
        self._worker().stop_remote_loops()

    def ping(self) -> int:
        return self.rank

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the Ray worker is not initialised")
        return self.worker


class RayExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        device = config.device
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False)
        world_size = config.parallel_config.world_size
        kind = "GPU" if device.type == "cuda" else "CPU"
        available = ray.cluster_resources().get(kind, 0)  # read before a shutdown below
        if available < world_size:
            if self._owns_ray:
                ray.shutdown()
            raise ValueError(
                f"tensor_parallel_size {world_size} needs {world_size} {kind}s in the Ray "
                f"cluster; it has {available:g}"
            )
        resource = {kind: 1}
        self.placement_group = placement_group([dict(resource)] * world_size, strategy="PACK")
        self.actors: list[Any] = []
        self._loops: list[Any] = []
        self._shut_down = False
        try:
            ray.get(self.placement_group.ready(), timeout=300)
            actor_cls = ray.remote(num_cpus=1 if device.type != "cuda" else 0)(RayWorkerWrapper)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, rank)
                options: dict[str, Any] = {"scheduling_strategy": strategy}
                if device.type == "cuda":
                    options["num_gpus"] = 1
                self.actors.append(actor_cls.options(**options).remote(config, rank, device.type))
            self._start(ray)
        except BaseException as error:
            self._fail(error)

    def _start(self, ray: Any) -> None:
        ip, port = ray.get(self.actors[0].get_address.remote())
        init_method = get_distributed_init_method(ip, port)
        answers = ray.get([actor.init_worker.remote(init_method) for actor in self.actors])
        self.kv_cache_info = answers[0]
        self._loops = [actor.execute_model_loop.remote() for actor in self.actors[1:]]

    def execute_model(self, plan: StepPlan) -> StepResults:
        if self._shut_down:
            raise RuntimeError("the Ray executor is shut down")
        try:
            results: StepResults = self._ray.get(self.actors[0].execute_model.remote(plan))
            return results
        except Exception as error:
            self._fail(error)

    def check_health(self) -> None:
        dead = self._dead_ranks()
        if dead:
            raise RuntimeError(f"tensor-parallel Ray worker rank {dead[0]} is dead")

    def _dead_ranks(self) -> list[int]:
        ray = self._ray
        dead = []
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.ping.remote(), timeout=PING_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError):
                dead.append(rank)
        return dead

    def _fail(self, error: BaseException) -> NoReturn:
        dead = self._dead_ranks() if self.actors else []
        self.shutdown(graceful=False)
        if not dead:
            raise error
        raise RuntimeError(f"tensor-parallel Ray worker rank {dead[0]} died: {error}") from error

    def shutdown(self, graceful: bool = True) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        ray = self._ray
        if graceful and self._loops:
            try:
                ray.get(self.actors[0].stop_remote_loops.remote(), timeout=PING_TIMEOUT_S)
                ray.get(self._loops, timeout=PING_TIMEOUT_S)
            except Exception as error:  # a broken group: the actors are killed below anyway
                logger.warning("Ray workers did not stop cleanly: %s", error)
        for actor in self.actors:
            ray.kill(actor)
        self._remove_placement_group(self.placement_group)
        if self._owns_ray:
            ray.shutdown()
