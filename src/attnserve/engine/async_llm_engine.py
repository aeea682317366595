"""`AsyncLLMEngine`: the same engine core, stepped by a background thread, for asyncio callers.

`generate(...)` is an async iterator of `RequestOutput`s for one request (cumulative by default;
`SamplingParams(output_kind=RequestOutputKind.DELTA)` gives only what is new). New requests are
queued to the engine thread, which takes them between steps, so the event loop never waits for a
step. `abort(request_id)` frees every block of the request as soon as the step in flight ends; a
consumer that stops iterating early aborts its request the same way.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.llm_engine import LLMEngine
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


@dataclass
class _NewRequest:
    """A request waiting for the engine thread to add it; `added` settles once it has."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]
    added: asyncio.Future[None]

    def settle(self, error: BaseException | None) -> None:
        def resolve() -> None:
            if self.added.done():
                return
            if error is None:
                self.added.set_result(None)
            else:
                self.added.set_exception(error)

        self.loop.call_soon_threadsafe(resolve)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._commands: queue.SimpleQueue[_NewRequest] = queue.SimpleQueue()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="attnserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine(args))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                self._run_commands()
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except BaseException as error:  # handed to every waiting caller
                    logger.exception("engine step failed")
                    self._fail(error)
                    return
                sinks = [(self._sinks.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._sinks.pop(output.request_id, None)
            for sink, output in sinks:
                if sink is not None:
                    sink[0].call_soon_threadsafe(sink[1].put_nowait, output)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _queued(self) -> list[_NewRequest]:
        found = []
        while True:
            try:
                found.append(self._commands.get_nowait())
            except queue.Empty:
                return found

    def _run_commands(self) -> None:
        """New requests queued by callers, taken in between steps (engine thread, locked)."""
        for new in self._queued():
            try:
                self.engine.add_request(new.request_id, new.prompt, new.params)
            except Exception as error:  # a bad request: raised in its caller
                new.settle(error)
                continue
            self._sinks[new.request_id] = (new.loop, new.outputs)
            new.settle(None)

    def _fail_queued(self) -> None:
        for new in self._queued():
            new.settle(EngineDeadError(f"the engine has failed: {self._error}"))

    def _fail(self, error: BaseException) -> None:
        self._error = error
        for request_id, (loop, sink) in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            loop.call_soon_threadsafe(sink.put_nowait, EngineDeadError(str(error)))
        self._sinks.clear()
        self._fail_queued()

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; ValueError for a bad request."""
        if self._error is not None:
            raise EngineDeadError(f"the engine has failed: {self._error}")
        loop = asyncio.get_running_loop()
        new = _NewRequest(
            request_id, prompt, sampling_params, loop, asyncio.Queue(), loop.create_future()
        )
        self._commands.put(new)  # the event loop never waits for a step to end
        self._wake.set()
        if self._error is not None:  # the engine died after the check above
            self._fail_queued()
        await new.added
        finished = False
        try:
            while not finished:
                item = await new.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are free when this returns."""
        with self._lock:
            self._sinks.pop(request_id, None)
            self.engine.abort_request(request_id)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # mid-step ranks are left to the exit-time cleanup
            self.engine.shutdown()
