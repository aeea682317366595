"""`ProcClient`: an engine core in a process of its own (spawned), behind one front end.

Commands go through one `multiprocessing.connection` pipe, messages come back through another
(pickle protocol 5), read by a background thread that hands step outputs to the output queue
and call replies to their waiters. When the pipe reads EOF (the process was killed or failed),
the client is dead: `EngineDeadError` names the pid and how it died; so it is when the core's
heartbeat stops for LIVENESS_TIMEOUT_S (the process is stopped or wedged: hung, and killed). The
process is not a daemon (a core with tensor parallelism starts worker processes of its own); it
is stopped on `shutdown()` and at interpreter exit (a shutdown command, then terminate, then
kill), and it stops by itself when the front end's process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

from attnserve.config.engine import EngineConfig
from attnserve.engine.core.messages import (
    PICKLE_PROTOCOL,
    Command,
    CoreAlive,
    CoreCommand,
    CoreFailed,
    CoreReady,
)
from attnserve.engine.core_client import ChannelClient, EngineDeadError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a large model on CPU takes minutes
# A ready core sends a heartbeat every HEARTBEAT_INTERVAL_S; none for this long: it is hung
LIVENESS_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 10.0  # then the core process is terminated, and then killed


_ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ meanwhile (what a process started now inherits)."""
    with _ENVIRONMENT_LOCK:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _exit_description(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class ProcClient(ChannelClient):
    """An engine core process (spawned): commands through one pipe, messages back through
    another, read by a background thread. Constructing it starts the process; `wait_ready`
    waits for the core to be up (so several can load at once)."""

    def __init__(
        self,
        config: EngineConfig,
        outputs: queue.SimpleQueue[Any] | None = None,
        env: dict[str, str] | None = None,
        num_threads: int | None = None,
        name: str = "attnserve-engine-core",
    ) -> None:
        from attnserve.engine.core.loop import run_engine_core_process

        super().__init__(outputs)
        context = multiprocessing.get_context("spawn")
        core_commands, self._commands = context.Pipe(duplex=False)
        self._messages, core_messages = context.Pipe(duplex=False)
        log_level = logging.getLogger().getEffectiveLevel()
        self.process = context.Process(
            target=run_engine_core_process,
            args=(config, core_commands, core_messages, num_threads, log_level),
            name=name,
        )  # not a daemon: a core with tensor parallelism starts worker processes of its own
        with _environment(env or {}):
            self.process.start()
        core_commands.close()
        core_messages.close()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        atexit.register(self.shutdown)

    @property
    def core_pids(self) -> list[int]:
        return [self.process.pid] if self.process.pid is not None else []

    def wait_ready(self) -> None:
        """Wait for the core's `CoreReady`; its own exception (or a RuntimeError) if it fails."""
        ready = wait([self._messages, self.process.sentinel], timeout=STARTUP_TIMEOUT_S)
        message = None
        if self._messages in ready:
            with contextlib.suppress(EOFError, OSError):
                message = pickle.loads(self._messages.recv_bytes())
        if isinstance(message, CoreReady):
            self.ready = message
            self._reader = threading.Thread(
                target=self._read, name="attnserve-core-reader", daemon=True
            )
            self._reader.start()
            return
        self.shutdown()
        if isinstance(message, CoreFailed):
            if isinstance(message.error, Exception):
                raise message.error
            raise RuntimeError(f"the engine core could not start: {message.message}")
        if not ready:
            raise RuntimeError(f"the engine core did not start in {STARTUP_TIMEOUT_S:.0f} s")
        raise RuntimeError(
            f"the engine core process (pid {self.process.pid}) exited while starting "
            f"({_exit_description(self.process.exitcode)})"
        )

    def _read(self) -> None:
        while True:
            try:
                if not self._messages.poll(LIVENESS_TIMEOUT_S) and not self._closed:
                    self.process.kill()  # nothing it holds can be had back: free it now
                    self._die(
                        f"the engine core process (pid {self.process.pid}) was hung: nothing from "
                        f"it for {LIVENESS_TIMEOUT_S:.0f} s, so it was killed"
                    )
                    return
                message = pickle.loads(self._messages.recv_bytes())
            except (EOFError, OSError):
                break
            if not isinstance(message, CoreAlive):
                self._dispatch(message)
        self._die(self._end_reason())

    def _end_reason(self) -> str:
        if self._closed or self._failure is not None:
            return super()._end_reason()
        self.process.join(SHUTDOWN_TIMEOUT_S)
        return (
            f"the engine core process (pid {self.process.pid}) died "
            f"({_exit_description(self.process.exitcode)})"
        )

    def _send(self, command: Command) -> None:
        data = pickle.dumps(command, protocol=PICKLE_PROTOCOL)
        with self._send_lock:
            if self.error is not None:
                raise self.error
            try:
                self._commands.send_bytes(data)
            except OSError as error:
                raise EngineDeadError(
                    f"the engine core process (pid {self.process.pid}) is gone"
                ) from error

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.process.is_alive():
            with contextlib.suppress(OSError), self._send_lock:
                self._commands.send_bytes(
                    pickle.dumps((CoreCommand.SHUTDOWN, None), protocol=PICKLE_PROTOCOL)
                )
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in time: terminating it")
            self.process.terminate()
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        with self._send_lock:
            self._commands.close()
        if self._reader is not None:
            self._reader.join(SHUTDOWN_TIMEOUT_S)
        else:
            self._die(self._end_reason())
        self._messages.close()


def core_num_threads(config: EngineConfig) -> int | None:
    """Torch threads for each CPU engine core: the host's cores less one (for the front end),
    shared by the cores; None (torch's default) on CUDA or when OMP_NUM_THREADS is set."""
    if config.device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, ((cpus or 1) - 1) // config.parallel_config.data_parallel_size)
