"""`MultiprocExecutor`: one process per rank on this host; rank 0 (the driver) is the engine
process itself.

Ranks 1..N-1 are `spawn`ed processes that join the process group on a free local port and then
wait in `Worker.execute_model_loop`. Each step the driver broadcasts the plan once and runs its
own shard. A monitor thread watches the workers' process sentinels: when one dies, it records
which rank and exit code, fails the driver's collectives and terminates the other workers, and
the engine gets a RuntimeError naming the rank. A worker exits when the driver tells it to, or
when the driver process dies (it watches its parent).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import NoReturn

import torch

from attnserve.config.engine import EngineConfig
from attnserve.distributed import get_distributed_init_method, get_open_port
from attnserve.distributed.parallel_state import abort_distributed_environment
from attnserve.executor.executor_base import ExecutorBase
from attnserve.executor.parent_watch import exit_with_parent
from attnserve.step_types import StepPlan, StepResults
from attnserve.worker.model_runner import ModelRunner
from attnserve.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # a worker must report in (imports done) within this
SHUTDOWN_TIMEOUT_S = 10.0  # then it is terminated, and killed
FAILURE_WAIT_S = 2.0  # how long a failed collective waits for the monitor to name the dead rank


class MultiprocExecutor(ExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        device = config.device
        self.world_size = config.parallel_config.world_size
        self._failure: str | None = None
        self._closing = threading.Event()  # set: worker deaths are expected, not failures
        self._broken = False  # a rank failed or a step raised: the group is unusable
        self._shut_down = False
        self._terminating = threading.Lock()  # the monitor and shutdown both stop the workers
        init_method = get_distributed_init_method("127.0.0.1", get_open_port())
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        pipes: list[Connection] = []
        for rank in range(1, self.world_size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=run_worker,
                args=(config, rank, _rank_device(device, rank), init_method, writer),
                name=f"attnserve-tp{rank}",
                daemon=True,
            )
            process.start()
            writer.close()
            self.processes.append(process)
            pipes.append(reader)
        self._finalizer = weakref.finalize(self, _terminate, list(self.processes), self._closing)
        atexit.register(self._closing.set)  # workers die with us at exit: no failure then
        self.driver = Worker(config, 0, _rank_device(device, 0), init_method)
        try:
            self._await(pipes, "started")
            threading.Thread(target=self._monitor, name="attnserve-tp-monitor", daemon=True).start()
            self.driver.init_device()
            self.kv_cache_info = self.driver.load_model()
            self._await(pipes, "ready")
        except BaseException as error:
            self._fail(error, _worker_errors(pipes))

    def _await(self, pipes: list[Connection], message: str) -> None:
        """Every worker's `message`; RuntimeError naming the first worker that fails instead."""
        for rank, (pipe, process) in enumerate(zip(pipes, self.processes, strict=True), 1):
            ready = wait([pipe, process.sentinel], timeout=STARTUP_TIMEOUT_S)
            if pipe in ready and pipe.poll() and pipe.recv() == message:
                continue
            if not ready:
                raise RuntimeError(f"tensor-parallel worker rank {rank} did not start in time")
            self._failure = _death_message(rank, process)
            raise RuntimeError(self._failure)

    def _fail(self, error: BaseException, details: str = "") -> NoReturn:
        """Shut everything down after `error`; re-raise it, or the dead worker's story."""
        self._broken = True
        failure = self._wait_for_failure() if isinstance(error, Exception) else self._failure
        self.shutdown()
        if failure is None:
            raise error
        raise RuntimeError(failure + details) from error

    def _monitor(self) -> None:
        """Wait for any worker to die; outside shutdown that is a failure of the whole group."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        dead = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank = sentinels[dead[0]]  # type: ignore[index]
        # the story first: a step checking health in between must not see a nameless failure
        self._failure = _death_message(rank, self.processes[rank - 1])
        self._broken = True
        logger.error("%s; shutting the other ranks down", self._failure)
        if self.device.type == "cuda":
            abort_distributed_environment()  # a blocked NCCL collective would never return
        with self._terminating:
            self._finalizer()

    @property
    def driver_runner(self) -> ModelRunner:
        return self.driver.runner

    def check_health(self) -> None:
        if self._shut_down and not self._broken:
            raise RuntimeError("the tensor-parallel executor is shut down")
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self._broken:
            raise RuntimeError("the tensor-parallel group failed in an earlier step")

    def execute_model(self, plan: StepPlan) -> StepResults:
        self.check_health()
        try:
            self._check_workers_alive()
            return self.driver.execute_model(plan)
        except BaseException as error:  # even an interrupt leaves the ranks out of step
            self._fail(error)

    def _check_workers_alive(self) -> None:
        """A worker already dead fails the step before its broadcast, whether or not the
        monitor has woken yet: gloo does not always see a dead peer, and a broadcast to one
        could then block for good. Its sentinel tells: `is_alive` can still say yes for a
        moment after the process has closed its files on the way out."""
        dead = wait([process.sentinel for process in self.processes], timeout=0)
        for rank, process in enumerate(self.processes, 1):
            if process.sentinel in dead or not process.is_alive():
                raise RuntimeError(f"tensor-parallel worker rank {rank} is not alive")

    def _wait_for_failure(self) -> str | None:
        """The monitor's finding, given a moment: a dead peer fails our collective first."""
        deadline = time.monotonic() + FAILURE_WAIT_S
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._failure

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        exiting = self._closing.is_set()  # at interpreter exit the workers are already stopping
        self._closing.set()
        if not (self._broken or exiting) and self.driver.model_runner is not None:
            self.driver.stop_remote_loops()
            for process in self.processes:
                process.join(SHUTDOWN_TIMEOUT_S)
        with self._terminating:
            self._finalizer()  # terminates what is left, once
        self.driver.shutdown()


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def _death_message(rank: int, process: BaseProcess) -> str:
    process.join(SHUTDOWN_TIMEOUT_S)  # reap it, for its exit code
    # A step's `is_alive()` in the main thread may reap it first: this thread's wait then finds
    # no child and the exit code lands a moment later, when that thread records it.
    deadline = time.monotonic() + FAILURE_WAIT_S
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return (
        f"tensor-parallel worker rank {rank} (pid {process.pid}) died with exit code "
        f"{process.exitcode}"
    )


def _worker_errors(pipes: list[Connection]) -> str:
    """What the workers reported before dying (their exception), if anything."""
    errors = []
    for pipe in pipes:
        with contextlib.suppress(OSError, EOFError):
            while pipe.poll():
                message = pipe.recv()
                if message not in ("started", "ready"):
                    errors.append(str(message))
    return "".join(f"; {error}" for error in errors)


def _terminate(processes: list[BaseProcess], closing: threading.Event | None = None) -> None:
    """Terminate, then kill, every process still alive (`closing` set first: no failure)."""
    if closing is not None:
        closing.set()
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(SHUTDOWN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def run_worker(
    config: EngineConfig,
    rank: int,
    device: torch.device,
    init_method: str,
    pipe: Connection,
) -> None:
    """A worker process: report in, join the group, load, report ready, serve steps."""
    exit_with_parent()
    worker = Worker(config, rank, device, init_method)
    try:
        pipe.send("started")
        worker.init_device()
        worker.load_model()
        pipe.send("ready")
        worker.execute_model_loop()
    except BaseException as error:
        logger.exception("tensor-parallel worker rank %d failed", rank)
        with contextlib.suppress(OSError):
            pipe.send(f"rank {rank}: {type(error).__name__}: {error}")
        raise SystemExit(1) from error
    finally:
        worker.shutdown()
