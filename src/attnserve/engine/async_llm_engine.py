"""`AsyncLLMEngine`: an `LLMEngine` for asyncio callers, its engine core in a process of its own
by default (`engine_core_process`), its outputs read by a background thread.

`generate(...)` is an async iterator of `RequestOutput`s for one request (cumulative by default;
`SamplingParams(output_kind=RequestOutputKind.DELTA)` gives only what is new). A request is checked
and sent to the core at once (a bad one raises ValueError in its caller; a grammar is compiled in a
worker thread first); the event loop never waits for a step. The output thread waits for each
core step and hands it to the event loop of the latest request, which runs it through the output
processor (detokenizing, stop strings) and puts each request's outputs in its mailbox (those of
requests on other event loops in one callback per loop): the outputs and the streams that write
them share one thread, so no lock is passed back and forth between two threads per token. A
consumer that falls behind gets everything produced since its last output merged into one
(DELTA outputs joined by `RequestOutput.merged`, otherwise the newest), so a slow client costs
one output, not one per token.
`abort(request_id)` ends a request (a consumer that stops iterating early aborts its request the
same way); `end_all(reason)` ends every request in flight with `RequestEndedError` (a server's
drain past its shutdown timeout); when the core dies, every waiting and later request raises
`EngineDeadError`, until `restart()` starts a new core (a new core that fails to start raises
`EngineDeadError` there, and stays the engine's error until a later `restart()` succeeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from attnserve.config import EngineArgs
from attnserve.engine.core.messages import EngineCoreOutputs
from attnserve.engine.core_client import EngineDeadError
from attnserve.engine.llm_engine import LLMEngine
from attnserve.lora.request import LoRARequest
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestEndedError"]

_Item = RequestOutput | BaseException
IDLE_POLL_S = 0.5  # an idle output thread looks at the core's health this often


class RequestEndedError(RuntimeError):
    """The request was ended before it finished (`AsyncLLMEngine.end_all`)."""


class _Mailbox:
    """One request's outputs waiting for its consumer, on its event loop: `put` by the output
    thread's callback, `take` all at once (a consumer that fell behind takes many)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list[_Item]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


_Sink = tuple[asyncio.AbstractEventLoop, _Mailbox]


def _put_all(items: list[tuple[_Mailbox, _Item]]) -> None:
    for mailbox, item in items:
        mailbox.put(item)


def _post(entries: list[tuple[_Sink, _Item]]) -> None:
    """Each item to its mailbox, from any thread: at once on this thread's event loop, one
    callback for each other event loop."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[_Mailbox, _Item]]] = defaultdict(list)
    for (loop, mailbox), item in entries:
        batches[loop].append((mailbox, item))
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for loop, items in batches.items():
        if loop is running:
            _put_all(items)
            continue
        with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
            loop.call_soon_threadsafe(_put_all, items)


def _merged(waiting: list[_Item], delta: bool) -> _Item:
    """Outputs that waited for their consumer, as one: DELTA outputs joined, otherwise the
    newest (each holds everything so far); an error wins."""
    error = next((item for item in waiting if isinstance(item, BaseException)), None)
    if error is not None:
        return error
    outputs = [item for item in waiting if isinstance(item, RequestOutput)]
    return RequestOutput.merged(outputs) if delta else outputs[-1]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, args: EngineArgs | None = None) -> None:
        if not engine.thread_safe:
            raise ValueError(
                "AsyncLLMEngine steps its engine from a thread of its own: build the LLMEngine "
                "with thread_safe=True or its core in a process (AsyncLLMEngine.from_engine_args)"
            )
        self.engine = engine
        self.args = args  # what `restart` builds a new engine from
        self._lock = threading.Lock()  # the sinks
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._stopped = False
        self._error: EngineDeadError | None = None
        self._last_stats: dict[str, float] | None = None
        # where core steps are processed: the event loop of the latest request (None: none yet)
        self._process_loop: asyncio.AbstractEventLoop | None = None
        self._thread = self._start_output_thread()

    def _start_output_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._loop, name="attnserve-outputs", daemon=True)
        thread.start()
        return thread

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine(args, default_core_process=True, thread_safe=True), args)

    def restart(self) -> None:
        """After the core died: shut the old engine down and start a new one from the same
        arguments. EngineDeadError when the new core does not start (the engine's error from
        then on: another restart() may follow) or the engine was shut down meanwhile;
        RuntimeError for an engine not built from arguments, or one still alive."""
        if self.args is None or self._error is None:
            raise RuntimeError("restart() needs a dead engine built by from_engine_args")
        self._thread.join(timeout=10)
        self.engine.shutdown()
        try:
            engine = LLMEngine(self.args, default_core_process=True, thread_safe=True)
        except Exception as error:
            failed = EngineDeadError(f"a new engine core did not start: {error}")
            with self._lock:
                self._error = failed
            raise failed from error
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self.engine, self._error = engine, None
        if stopped:
            engine.shutdown()
            raise EngineDeadError("the engine was shut down while a new core started")
        self._last_stats = None
        self._thread = self._start_output_thread()

    @property
    def core_pids(self) -> list[int]:
        """The engine core processes' ids (none for a core in this process)."""
        return self.engine.client.core_pids

    def end_all(self, reason: str) -> None:
        """End every request in flight: each raises `RequestEndedError(reason)` in its caller
        and is aborted in the core."""
        with self._lock:
            ended, self._sinks = self._sinks, {}
        _post([(sink, RequestEndedError(reason)) for sink in ended.values()])
        for request_id in ended:
            if self._error is None:
                self.engine.abort_request(request_id)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead, once it is."""
        return self._error

    @property
    def errored(self) -> bool:
        """The engine core has failed or is gone (checked now, even with nothing running)."""
        if self._error is None:
            try:
                self.engine.check_health()
            except EngineDeadError as error:
                self._fail(error)
        return self._error is not None

    def _loop(self) -> None:
        while not self._stopped and self._error is None:
            if not self.engine.has_unfinished_requests():
                if self._wake.wait(timeout=IDLE_POLL_S):
                    self._wake.clear()
                elif self.errored:
                    return
                continue
            try:
                core_outputs = self.engine.client.get_output()
            except BaseException as error:
                if not self._stopped:
                    self._failed(error)
                return
            taken = time.monotonic()
            loop = self._process_loop
            if loop is not None:
                with contextlib.suppress(RuntimeError):  # its loop is closed: processed here
                    loop.call_soon_threadsafe(self._process, core_outputs, taken)
                    continue
            self._process(core_outputs, taken)

    def _process(self, core_outputs: EngineCoreOutputs, taken: float) -> None:
        """Turn one core step into outputs and hand them to their requests: on the event loop
        of the latest request (one thread for the outputs and the streams that write them: no
        lock passed back and forth between the two per token)."""
        try:
            outputs = self.engine.process(core_outputs, taken)
        except BaseException as error:
            self._failed(error)
            return
        self._deliver(outputs)

    def _failed(self, error: BaseException) -> None:
        """A step failed (in the core, or turning it into outputs): every waiting caller gets
        the error."""
        logger.error("the engine failed: %s", error)
        self._fail(error if isinstance(error, EngineDeadError) else EngineDeadError(error))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        entries: list[tuple[_Sink, _Item]] = []
        with self._lock:
            for output in outputs:
                sink = self._sinks.get(output.request_id)
                if sink is not None:
                    entries.append((sink, output))
                    if output.finished:
                        del self._sinks[output.request_id]
        _post(entries)

    def _fail(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            sinks, self._sinks = list(self._sinks.values()), {}
        _post([(sink, error) for sink in sinks])

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        data_parallel_rank: int | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; ValueError for a bad request.
        `priority`, `lora_request`: see `LLMEngine.add_request`."""
        if self.errored and self._error is not None:
            raise self._error
        if sampling_params.structured_outputs is not None:  # compiled off the event loop
            await asyncio.to_thread(self.engine.processor.compile_grammar, sampling_params)
        mailbox = _Mailbox()
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = (loop, mailbox)
        self._process_loop = loop
        try:
            self.engine.add_request(
                request_id, prompt, sampling_params, data_parallel_rank, priority, lora_request
            )
        except BaseException:
            with self._lock:
                self._sinks.pop(request_id, None)
            raise
        self._wake.set()
        delta = sampling_params.output_kind is RequestOutputKind.DELTA
        finished = False
        try:
            while not finished:
                item = _merged(await mailbox.take(), delta)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; no output of it comes any more, and its blocks are freed by the core
        before anything sent after this."""
        with self._lock:
            self._sinks.pop(request_id, None)
        if self._error is None:
            self.engine.abort_request(request_id)

    def stats(self) -> dict[str, float]:
        """The core's gauges, after every command sent before (the last ones it gave, once it
        is gone)."""
        return self._gauges(self.engine.stats)

    def latest_stats(self) -> dict[str, float]:
        """The core's gauges as it last pushed them: at once, never waiting for a step."""
        return self._gauges(self.engine.latest_stats)

    def _gauges(self, read: Callable[[], dict[str, float]]) -> dict[str, float]:
        if not self.errored:
            try:
                self._last_stats = read()
            except EngineDeadError as error:
                self._fail(error)
        if self._last_stats is None:
            raise self._error or EngineDeadError("the engine has failed")
        return self._last_stats

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self.engine.shutdown()  # a step being waited for ends with EngineDeadError
        self._thread.join(timeout=10)
