"""`AsyncLLMEngine`: the same engine core, stepped by a background thread, for asyncio callers.

`generate(...)` is an async iterator of `RequestOutput`s for one request (cumulative by default;
`SamplingParams(output_kind=RequestOutputKind.DELTA)` gives only what is new). `abort(request_id)`
frees every block of the request as soon as the step in flight ends; a consumer that stops
iterating early aborts its request the same way. Engine calls are serialised by one lock.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.llm_engine import LLMEngine
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
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
            self._wake.wait(timeout=0.5)
            with self._lock:
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
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

    def _fail(self, error: BaseException) -> None:
        self._error = error
        for request_id, (loop, queue) in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(str(error)))
        self._sinks.clear()

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; ValueError for a bad request."""
        if self._error is not None:
            raise EngineDeadError(f"the engine has failed: {self._error}")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, sampling_params)
            self._sinks[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
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
