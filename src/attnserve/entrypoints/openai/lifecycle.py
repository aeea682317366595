"""The server's life after start-up: the requests in flight counted, a graceful drain on SIGTERM
or SIGINT, what a dead engine core leads to, and bounded request reads.

- **Drain**: the first SIGTERM/SIGINT stops new work (every `/v1` request gets 503, `/health`
  503) and lets the requests in flight finish for up to `--shutdown-timeout`; the rest are then
  ended (`AsyncLLMEngine.end_all`: an error event and `[DONE]` on a stream, a 503 error object
  otherwise), and the server exits 0 once their answers are out. A second signal exits at once.
- **A dead engine core** (killed, failed, or hung: no heartbeat): the requests in flight fail as
  they do today; then the server exits 1 once their answers are out (so a supervisor restarts
  it), or with `--restart-engine-core` a new core is started and serving goes on (each restart
  counted in `/metrics`).
- **Reads**: a connection whose request line and headers have not arrived within
  `--request-read-timeout` is closed (`server_protocol`), and a request whose body has not
  arrived whole by then gets 408 (`BodyDeadlineMiddleware`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.errors import ApiError, send_error
from attnserve.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

POLL_S = 0.05
ANSWERS_OUT_S = 5.0  # after ending the requests, at most this long for their answers to go out
WATCH_S = 0.5  # how often the engine's health is looked at


class ServerLifecycle:
    """Requests in flight, draining, and the engine watch; `server` is the uvicorn server it
    stops (None in tests that drive the app without one)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: ServerMetrics,
        shutdown_timeout_s: float = 30.0,
        restart_engine_core: bool = False,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.shutdown_timeout_s = shutdown_timeout_s
        self.restart_engine_core = restart_engine_core
        self.server: uvicorn.Server | None = None
        self.in_flight = 0
        self.draining = False
        self.exit_code = 0
        self._drain_task: asyncio.Task[None] | None = None

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
        # kept: the loop holds only a weak reference to a task
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        if not await self._until_idle(self.shutdown_timeout_s):
            logger.warning("ending %d requests still in flight", self.in_flight)
            self.engine.end_all(
                f"the server is shutting down: the request did not finish within its "
                f"{self.shutdown_timeout_s:g} s shutdown timeout"
            )
            await self._until_idle(ANSWERS_OUT_S)
        self._stop_server()

    async def _until_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.in_flight

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def watch_engine(self) -> None:
        """Until the server stops: when the engine core dies, restart it or stop the server."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self.draining or not self.engine.errored:
                continue
            if self.restart_engine_core:
                logger.error("the engine core died (%s): starting a new one", self.engine.error)
                await asyncio.to_thread(self.engine.restart)
                self.metrics.restarts.inc()
                continue
            logger.error("the engine core died (%s): the server exits", self.engine.error)
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
    """408 for a request whose body has not arrived whole `timeout_s` after its headers: the
    body is read here, within that time, and handed to the app as it came."""

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
    """uvicorn's server, whose first SIGTERM/SIGINT drains (`ServerLifecycle.begin_drain`)
    instead of stopping; a second one stops at once. Signals are not raised again on exit, so
    a drained server exits with its own code."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.lifecycle.draining:
            self.should_exit = self.force_exit = True
            return
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self.lifecycle.begin_drain)
