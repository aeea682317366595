"""The engine core's busy loop, and the entry point of an engine core process.

`run_core` serves one `EngineCore` until it is told to stop: it takes every queued command
between steps (adds, aborts, stop-string finishes, calls), runs one step and emits ONE
`EngineCoreOutputs` for it, and when it has nothing to do it blocks until a command comes. Its
gauges (`CoreGauges`) go out every GAUGE_INTERVAL_S while it steps and before it blocks. The
transport is two callables, so the same loop runs in a thread (queues) or in a process of its own
(`run_engine_core_process`: `multiprocessing.connection` pipes, pickle protocol 5).

The core process imports the engine's lower half only (this module, `EngineCore`, the executor
and the model), never the front end's tokenizer or server stack. It ignores SIGINT (the front end
decides when it stops), and it exits when its front end goes away: the command pipe then reads
EOF, and a watcher thread ends the process if the parent dies while a step is running. Once
ready it sends a heartbeat (`CoreAlive`) from a thread of its own, also while a step runs, so
its front end can tell a hung (stopped, wedged) core from a busy one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from attnserve.config.engine import EngineConfig
from attnserve.engine.core.engine_core import EngineCore
from attnserve.engine.core.messages import (
    CALLABLE_METHODS,
    GAUGE_INTERVAL_S,
    HEARTBEAT_INTERVAL_S,
    PICKLE_PROTOCOL,
    CallReply,
    Command,
    CoreAlive,
    CoreCommand,
    CoreFailed,
    CoreGauges,
    CoreMessage,
)
from attnserve.executor.parent_watch import exit_with_parent

logger = logging.getLogger(__name__)

Take = Callable[[bool], list[Command]]  # block (nothing to do) -> the queued commands
Emit = Callable[[CoreMessage], None]


class TransportClosed(Exception):
    """The front end's end of the channel is gone: stop quietly."""


def _apply(core: EngineCore, command: Command, emit: Emit) -> bool:
    """Carry out one command; False for shutdown."""
    kind, payload = command
    if kind is CoreCommand.ADD:
        core.add_request(payload)
    elif kind is CoreCommand.ABORT:
        core.abort_requests(payload)
    elif kind is CoreCommand.FINISH:
        core.finish_sequences(payload)
    elif kind is CoreCommand.CALL:
        call_id, method = payload
        if method not in CALLABLE_METHODS:
            raise ValueError(f"the engine core has no call {method!r}")
        emit(CallReply(call_id, getattr(core, method)()))
    return kind is not CoreCommand.SHUTDOWN


def run_core(core: EngineCore, take: Take, emit: Emit) -> bool:
    """Serve `core` until a shutdown command (or the channel closes), then shut it down; False
    after a failure, which is emitted as `CoreFailed` first."""
    gauges_at = 0.0  # time.monotonic() of the last `CoreGauges`
    try:
        while True:
            idle = not core.has_work()
            if idle or time.monotonic() - gauges_at >= GAUGE_INTERVAL_S:
                emit(CoreGauges(core.stats()))
                gauges_at = time.monotonic()
            for command in take(idle):
                if not _apply(core, command, emit):
                    return True
            if core.has_work():
                outputs = core.step()
                if outputs.outputs or outputs.finished_requests:
                    emit(outputs)
    except TransportClosed:
        logger.info("the front end went away: the engine core stops")
        return True
    except BaseException as error:
        logger.exception("the engine core failed")
        with contextlib.suppress(TransportClosed):
            emit(CoreFailed.from_error(error))
        return False
    finally:
        core.shutdown()


def pipe_take(conn: Connection) -> Take:
    """Commands from a pipe, read as they come by a thread of their own (so the pipe never fills
    while a step runs and a front end sending a burst of requests never waits for a step);
    `take` blocks for the first when asked to, then returns whatever has come."""
    arrived: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: the pipe closed

    def read() -> None:
        try:
            while True:
                arrived.put(pickle.loads(conn.recv_bytes()))
        except (EOFError, OSError):
            arrived.put(None)

    threading.Thread(target=read, name="attnserve-core-commands", daemon=True).start()
    closed = False

    def take(block: bool) -> list[Command]:
        nonlocal closed
        if closed:
            raise TransportClosed
        received = [arrived.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                received.append(arrived.get_nowait())
        commands = [command for command in received if command is not None]
        if len(commands) < len(received):  # the pipe closed after these
            closed = True
            if not commands:
                raise TransportClosed
        return commands

    return take


def pipe_emit(conn: Connection) -> Emit:
    """Messages into a pipe, from any thread (the loop's and the heartbeat's)."""
    lock = threading.Lock()

    def emit(message: CoreMessage) -> None:
        try:
            data = pickle.dumps(message, protocol=PICKLE_PROTOCOL)
        except Exception:  # a failure whose exception does not pickle: its message does
            if not isinstance(message, CoreFailed):
                raise
            data = pickle.dumps(CoreFailed(message.message), protocol=PICKLE_PROTOCOL)
        try:
            with lock:
                conn.send_bytes(data)
        except OSError as error:
            raise TransportClosed from error

    return emit


def start_heartbeat(emit: Emit) -> None:
    """A daemon thread that emits `CoreAlive` every HEARTBEAT_INTERVAL_S until the channel
    closes: while it comes, the process runs (a stopped or wedged process sends none)."""

    def beat() -> None:
        with contextlib.suppress(TransportClosed):
            while True:
                emit(CoreAlive())
                time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="attnserve-core-heartbeat", daemon=True).start()


def run_engine_core_process(
    config: EngineConfig,
    commands: Connection,
    messages: Connection,
    num_threads: int | None,
    log_level: int,
) -> None:
    """The body of an engine core process: build the core, report `CoreReady` (or
    `CoreFailed`), then `run_core` over the two pipes; exit code 1 after a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    emit = pipe_emit(messages)
    try:
        core = EngineCore(config)
    except BaseException as error:
        logger.exception("the engine core could not start")
        with contextlib.suppress(TransportClosed):
            emit(CoreFailed.from_error(error))
        raise SystemExit(1) from error
    gc.freeze()  # what start-up built lives as long as the process: keep it out of collections
    emit(core.ready_message())
    start_heartbeat(emit)
    clean = run_core(core, pipe_take(commands), emit)
    # The core is shut down: end here, without the interpreter's teardown (compiled-kernel
    # bindings report their objects as leaked then).
    logging.shutdown()
    os._exit(0 if clean else 1)
