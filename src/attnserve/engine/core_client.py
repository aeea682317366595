"""How the front end reaches its engine core: `InprocClient` (direct calls, this thread) and
`ThreadClient` (the core loop in a background thread) here; `ProcClient` (`proc_client`: the core
in a process of its own) and `DPClient` (`dp_client`: several core processes) build on
`ChannelClient`.

Every client takes requests, aborts and stop-string finishes, hands out the core's
`EngineCoreOutputs` one step at a time (`get_output`, blocking until the next step) and answers
`stats()` (and `latest_stats()`: the gauges the core last pushed, at once). The background
clients only queue commands, so a caller never waits for a step; a
call (`stats`) is answered in order, after every command sent before it. When the core dies
(its process is killed, a step raises), every waiting and later use raises `EngineDeadError`
within moments: the process's pipe reads EOF, and a reader thread turns that into the error.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import queue
import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from attnserve.config.engine import EngineConfig
from attnserve.engine.core.messages import (
    CallReply,
    Command,
    CoreCommand,
    CoreFailed,
    CoreGauges,
    CoreMessage,
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
)

if TYPE_CHECKING:
    from attnserve.engine.core.engine_core import EngineCore

CALL_TIMEOUT_S = 300.0  # a call waits for the step in flight; past this the core is stuck
SHUTDOWN_TIMEOUT_S = 10.0  # for the core thread to stop


class EngineDeadError(RuntimeError):
    """The engine core has failed or is gone; no request can be served any more."""


class EngineCoreClient(ABC):
    ready: CoreReady

    @abstractmethod
    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (EngineDeadError once the core is gone)."""

    @abstractmethod
    def stats(self) -> dict[str, float]: ...

    def latest_stats(self) -> dict[str, float]:
        """The core's gauges as it last pushed them (`CoreGauges`): at once, without waiting
        for the step in flight."""
        return self.stats()

    @abstractmethod
    def reset_stats(self) -> None:
        """Start the core's counters again (`EngineCore.reset_stats`)."""

    @abstractmethod
    def check_health(self) -> None:
        """EngineDeadError when the core is gone."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core and free what it holds (idempotent)."""

    @property
    def core_pids(self) -> list[int]:
        """The ids of the core's processes (none for a core in this process)."""
        return []

    @property
    def engine_core(self) -> EngineCore:
        """The core itself, when it lives in this process (for tests and benchmarks)."""
        raise RuntimeError("the engine core runs in its own process (engine_core_process)")


def _check_rank(rank: int | None) -> None:
    if rank not in (None, 0):
        raise ValueError(f"data_parallel_rank {rank} is out of range for one engine core")


class InprocClient(EngineCoreClient):
    """The core in this thread: every call runs at once (not thread-safe)."""

    def __init__(self, config: EngineConfig) -> None:
        from attnserve.engine.core.engine_core import EngineCore

        self.core = EngineCore(config)
        self.ready = self.core.ready_message()

    @property
    def engine_core(self) -> EngineCore:
        return self.core

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        _check_rank(data_parallel_rank)
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.core.finish_sequences(sequences)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step() if self.core.has_work() else EngineCoreOutputs()

    def stats(self) -> dict[str, float]:
        return self.core.stats()

    def reset_stats(self) -> None:
        self.core.reset_stats()

    def check_health(self) -> None:
        """The core runs in this thread: alive as long as the caller is."""

    def shutdown(self) -> None:
        self.core.shutdown()


class ChannelClient(EngineCoreClient):
    """A core served by `run_core` elsewhere: commands go out through `_send`, and every
    message from the core comes back through `_dispatch` (step outputs to the output queue,
    call replies to their waiters)."""

    def __init__(self, outputs: queue.SimpleQueue[Any] | None = None) -> None:
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | EngineDeadError] = (
            outputs if outputs is not None else queue.SimpleQueue()
        )
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._closed = False
        self._gauges: dict[str, float] | None = None
        self.error: EngineDeadError | None = None

    @abstractmethod
    def _send(self, command: Command) -> None: ...

    def _dispatch(self, message: CoreMessage) -> None:
        if isinstance(message, EngineCoreOutputs):
            self._outputs.put(message)
        elif isinstance(message, CallReply):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is not None:
                future.set_result(message.result)
        elif isinstance(message, CoreGauges):
            self._gauges = message.stats
        elif isinstance(message, CoreFailed):
            self._failure = message.message

    def _die(self, reason: str) -> None:
        """The core is gone: fail every waiting call, and every `get_output` from now on."""
        with self._lock:
            if self.error is not None:
                return
            self.error = EngineDeadError(reason)
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(self.error)
        self._outputs.put(self.error)

    def add_request(
        self, request: EngineCoreRequest, data_parallel_rank: int | None = None
    ) -> None:
        _check_rank(data_parallel_rank)
        self._send((CoreCommand.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.error is None:
            self._send((CoreCommand.ABORT, request_ids))

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        if sequences and self.error is None:
            self._send((CoreCommand.FINISH, sequences))

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # for the next caller too
            raise item
        return item

    def call(self, method: str) -> Any:
        """`method()` on the core, after every command sent before this one."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                raise self.error
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send((CoreCommand.CALL, (call_id, method)))
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError as error:
            raise EngineDeadError(
                f"the engine core did not answer in {CALL_TIMEOUT_S:.0f} s"
            ) from error

    def stats(self) -> dict[str, float]:
        result: dict[str, float] = self.call("stats")
        return result

    def latest_stats(self) -> dict[str, float]:
        gauges = self._gauges  # (the core pushes its first as soon as it serves)
        return self.stats() if gauges is None else gauges

    def reset_stats(self) -> None:
        self.call("reset_stats")

    def check_health(self) -> None:
        if self.error is not None:
            raise self.error

    def _end_reason(self) -> str:
        if self._closed:
            return "the engine core is shut down"
        if self._failure is not None:
            return f"the engine core failed: {self._failure}"
        return "the engine core stopped"


class ThreadClient(ChannelClient):
    """The core loop in a background thread of this process (the in-process mode of
    `AsyncLLMEngine`): the same commands and outputs as a core process, no pickling."""

    def __init__(self, config: EngineConfig) -> None:
        from attnserve.engine.core.engine_core import EngineCore

        super().__init__()
        self.core = EngineCore(config)
        self.ready = self.core.ready_message()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="attnserve-engine-core", daemon=True)
        self._thread.start()

    @property
    def engine_core(self) -> EngineCore:
        return self.core

    def _run(self) -> None:
        from attnserve.engine.core.loop import run_core

        run_core(self.core, self._take, self._dispatch)
        self._die(self._end_reason())

    def _take(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._commands.get_nowait())
        return commands

    def _send(self, command: Command) -> None:
        if self.error is not None:
            raise self.error
        self._commands.put(command)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put((CoreCommand.SHUTDOWN, None))
        self._thread.join(SHUTDOWN_TIMEOUT_S)
