"""The server's life after start-up: the requests in flight counted, a graceful drain on SIGTERM
or SIGINT, what a dead engine core leads to, and bounded request reads.

- **Drain**: the first SIGTERM/SIGINT stops new work (every `/v1` request gets 503, `/health`
  503) and lets the requests in flight finish for up to `--shutdown-timeout`; the rest are then
  ended (`AsyncLLMEngine.end_all`: an error event and `[DONE]` on a stream, a 503 error object
  otherwise), and the server exits 0 once their answers are out. A second signal ends every
  request in flight at once (the same way) and exits 128 + the signal's number (130 for SIGINT)
  once their answers are out; a third stops at once.
- **A dead engine core** (killed, failed, or hung: no heartbeat): the requests in flight fail as
  they do today; then the server exits 1 once their answers are out (so a supervisor restarts
  it), or with `--restart-engine-core` new cores are started until one serves (`engine_restart`:
  with back-off, at most `--max-engine-core-restarts` in a row, then the server exits 1). A
  server that stops for any reason while its engine core is dead exits 1.
- **Reads**: a connection whose request line and headers have not arrived within
  `--request-read-timeout` is closed (`server_protocol`), and a request whose body has not
  arrived whole by then gets 408 (`BodyDeadlineMiddleware`; a body nested too deeply: 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from attnserve.config.frontend import DEFAULT_MAX_ENGINE_CORE_RESTARTS
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.engine_restart import EngineRestarter
from attnserve.entrypoints.openai.errors import ApiError, send_error
from attnserve.entrypoints.openai.json_body import TOO_DEEP, too_deep
from attnserve.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

POLL_S = 0.05
ANSWERS_OUT_S = 5.0  # after ending the requests, at most this long for their answers to go out
WATCH_S = 0.5  # how often the engine's health is looked at


class ServerLifecycle:
    """Requests in flight, draining, signals, and the engine watch; `server` is the uvicorn
    server it stops (None in tests that drive the app without one)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: ServerMetrics,
        shutdown_timeout_s: float = 30.0,
        restart_engine_core: bool = False,
        max_engine_core_restarts: int = DEFAULT_MAX_ENGINE_CORE_RESTARTS,
    ) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.restarter = (
            EngineRestarter(engine, metrics, max_engine_core_restarts)
            if restart_engine_core
            else None
        )
        self.server: uvicorn.Server | None = None
        self.in_flight = 0
        self.draining = False
        self.exit_code = 0
        self.signals = 0
        self._tasks: set[asyncio.Task[None]] = set()  # the loop holds only weak references

    def engine_failure(self) -> str:
        """What /health says once the engine core is dead: why, or that it is restarting."""
        if self.restarter is not None and self.restarter.status is not None:
            return self.restarter.status
        return f"the engine has failed: {self.engine.error}"

    def on_signal(self, sig: int) -> None:
        """SIGTERM or SIGINT (on the event loop): the first drains, the second ends every
        request now, the third stops at once (see the module docstring)."""
        self.signals += 1
        if self.signals == 1:
            self.begin_drain()
        elif self.signals == 2:
            self._end_now(sig)
        elif self.server is not None:
            self.server.should_exit = self.server.force_exit = True

    def begin_drain(self) -> None:
        """Stop taking requests and drain (see the module docstring); called once."""
        if self.draining:
            return
        self.draining = True
        logger.info(
            "shutting down: %d requests in flight get %.0f s to finish",
            self.in_flight,
            self.shutdown_timeout_s,
        )
        self._spawn(self._drain())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        if not await self._until_idle(self.shutdown_timeout_s):
            logger.warning("ending %d requests still in flight", self.in_flight)
            self.engine.end_all(
                f"the server is shutting down: the request did not finish within its "
                f"{self.shutdown_timeout_s:g} s shutdown timeout"
            )
            await self._until_idle(ANSWERS_OUT_S)
        self._stop_server()

    def _end_now(self, sig: int) -> None:
        name = signal.Signals(sig).name
        logger.warning("a second %s: ending the %d requests in flight now", name, self.in_flight)
        self.draining = True
        self.exit_code = self.exit_code or 128 + sig
        self.engine.end_all(f"the server is shutting down now (a second {name})")
        self._spawn(self._stop_when_idle())

    async def _stop_when_idle(self) -> None:
        await self._until_idle(ANSWERS_OUT_S)
        self._stop_server()

    async def _until_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.in_flight

    def _stop_server(self) -> None:
        if self.engine.errored and not self.exit_code:
            logger.error("the server stops with its engine core dead: exit code 1")
            self.exit_code = 1
        if self.server is not None:
            self.server.should_exit = True

    async def watch_engine(self) -> None:
        """Until the server stops: when the engine core dies, restart it (with
        --restart-engine-core) or stop the server."""
        while True:
            await asyncio.sleep(WATCH_S)
            if not self.engine.errored:
                continue
            logger.error("the engine core died: %s", self.engine.error)
            if self.draining:  # stopping anyway: no restart, and the exit code says so
                self.exit_code = self.exit_code or 1
                return
            if self.restarter is not None and await self.restarter.restart():
                continue
            if self.restarter is None:
                logger.error("the server exits 1 (--restart-engine-core would start a new core)")
            self.draining = True
            self.exit_code = 1
            await self._until_idle(ANSWERS_OUT_S)
            self._stop_server()
            return


class InFlightMiddleware:
    """Counts the `/v1` requests in flight; while the server drains, new ones get 503."""

    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            await send_error(
                send, ApiError(503, "the server is shutting down", code="shutting_down")
            )
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1


class BodyDeadlineMiddleware:
    """408 for a request whose body has not arrived whole `timeout_s` after its headers, 400
    for one nested too deeply (`json_body.too_deep`): the body is read here, within that time,
    and handed to the app as it came."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            received = await asyncio.wait_for(_whole_body(receive), self.timeout_s)
        except TimeoutError:
            await send_error(send, ApiError(408, "the request body did not arrive in time"))
            return
        except HTTPException as error:  # from the body limit's receive
            await send_error(send, ApiError(error.status_code, str(error.detail)))
            return
        if too_deep(b"".join(message.get("body", b"") for message in received)):
            await send_error(send, ApiError(400, TOO_DEEP))
            return

        async def replayed() -> Message:
            return received.pop(0) if received else await receive()

        await self.app(scope, replayed, send)


async def _whole_body(receive: Receive) -> list[Message]:
    """The request's messages up to its last body chunk (or a disconnect)."""
    messages = [await receive()]
    while messages[-1]["type"] == "http.request" and messages[-1].get("more_body", False):
        messages.append(await receive())
    return messages


class ReadTimeout:
    """A mixin for uvicorn's HTTP protocols (h11's or httptools'): close a connection that has
    not sent a whole request line and headers within `read_timeout_s` of its first bytes (or of
    its opening)."""

    read_timeout_s = 30.0
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._read_timer: asyncio.TimerHandle | None = None
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm_read_timer()
        super().data_received(data)  # type: ignore[misc]

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_read_timer(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._between_requests() and not self.transport.is_closing():
            logger.info("closing a connection whose request did not arrive in time")
            self.transport.close()


def server_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """The HTTP protocol `attnserve serve` runs: httptools' parser where it is installed (as
    uvicorn's own "auto" picks, and vLLM's server runs: a C parser, a few microseconds an event
    instead of tens), else h11's; with the read timeout."""
    base: type[asyncio.Protocol] = H11Protocol
    with contextlib.suppress(ImportError):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    return type("ServerProtocol", (ReadTimeout, base), {"read_timeout_s": read_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM/SIGINT go to `ServerLifecycle.on_signal` (drain, end
    now, stop) instead of stopping it. Signals are not raised again on exit, so the server exits
    with the lifecycle's code."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        asyncio.get_event_loop().call_soon_threadsafe(self.lifecycle.on_signal, sig)
