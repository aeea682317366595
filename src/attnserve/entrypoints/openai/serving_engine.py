"""`OpenAIServing`, what every endpoint shares on the engine's side: the checks of `RequestChecks`
run on the server's `PreprocessPool` (`off_loop`), never on the event loop, and the engine
requests of one API call run as one stream of `Delta`s (`generate`), behind the server's
`Admission`, with its metrics recorded and the request timeout kept.

A structured-output spec that does not compile is refused (400) when the engine compiles it at
submission. Every engine request is streamed as deltas (the non-streaming endpoints add them up,
`replies`); when the caller stops reading (the client went away), every engine request of the
call is aborted at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import ParamSpec, TypeVar

from starlette.requests import Request

from attnserve.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestEndedError
from attnserve.entrypoints.openai.admission import Admission
from attnserve.entrypoints.openai.deltas import Delta
from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.merge_streams import Batch, merge_streams, one_stream
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.preprocess import LARGE_JOB_BYTES, PreprocessPool
from attnserve.entrypoints.openai.protocol import SamplingRequest
from attnserve.entrypoints.openai.request_checks import RequestChecks
from attnserve.entrypoints.openai.serving_models import OpenAIServingModels
from attnserve.entrypoints.openai.structured import constraint_field
from attnserve.lora.request import LoRARequest
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

P = ParamSpec("P")
T = TypeVar("T")


class OpenAIServing(RequestChecks):
    request_timeout_s: float | None = None  # a request still running after this gets a 504

    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: OpenAIServingModels,
        metrics: ServerMetrics,
        pool: PreprocessPool,
    ) -> None:
        """`models`, `metrics`, `pool`: the server's, shared by its endpoints."""
        super().__init__(engine, models)
        self.metrics = metrics
        self.admission = Admission()  # the server's own: set by `build_app`
        self.pool = pool

    async def off_loop(
        self, raw: Request, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`fn(*args, **kwargs)` on the preprocessing pool, as a job the size of the request's
        body (a body of unknown length counts as large)."""
        length = raw.headers.get("content-length", "")
        size = int(length) if length.isdigit() else LARGE_JOB_BYTES
        return await self.pool.run(size, fn, *args, **kwargs)

    def generate(
        self,
        request: SamplingRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        received: float,
    ) -> AsyncGenerator[list[Delta], None]:
        """Each engine output of the call's prompts, as deltas, under the request's priority
        (lower runs earlier) and LoRA adapter (its `model`); ApiError for a failure (a
        constraint the compiler refuses is named by the field it came from). `received`: when
        the call's handler started (time.monotonic()); the prompts are ready now."""
        times = (received, time.monotonic())
        engine_request = (request.priority, self.models.lora_request(request.model))
        constraint = constraint_field(request)
        return self._deltas(prompts, params, request_id, times, constraint, engine_request)

    async def _deltas(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        times: tuple[float, float],
        constraint: str | None,
        engine_request: tuple[int, LoRARequest | None],
    ) -> AsyncGenerator[list[Delta], None]:
        ticket = self.admission.admit()
        streams = self._streams(prompts, params, request_id, engine_request)
        trackers = [self.metrics.tracker(*times) for _ in streams]
        merged = (
            merge_streams(streams, trackers)
            if len(streams) > 1
            else one_stream(streams[0], trackers[0])
        )
        started = time.monotonic()
        try:
            async with aclosing(merged):
                while (batch := await self._next_batch(merged, started)) is not None:
                    ticket.leave(started=True)
                    delivered = time.monotonic()
                    yield [
                        Delta(
                            i * params.n + c.index,
                            c.text,
                            c.token_ids,
                            c.logprobs,
                            c.finish_reason,
                            output.prompt_logprobs,
                            delivered,
                        )
                        for i, output in batch
                        for c in output.outputs
                        if c.token_ids or c.text or c.finish_reason
                    ]
        except ValueError as error:
            raise _invalid(error, constraint) from error
        except EngineDeadError as error:
            self.metrics.failures.labels("engine_failed").inc()
            raise ApiError(503, f"the engine has failed: {error}") from error
        except RequestEndedError as error:
            self.metrics.failures.labels("shutdown").inc()
            raise ApiError(503, str(error)) from error
        except TimeoutError:
            self.metrics.failures.labels("timeout").inc()
            limit = f"--request-timeout {self.request_timeout_s:g} s"
            raise ApiError(504, f"the request ran past the server's {limit}") from None
        finally:
            ticket.leave(started=False)

    def _streams(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        engine_request: tuple[int, LoRARequest | None],
    ) -> list[AsyncIterator[RequestOutput]]:
        """Each prompt's engine stream (under the request's priority and LoRA adapter), behind
        the request's prompt gate (`Admission`)."""
        priority, lora = engine_request
        streams = [
            functools.partial(
                self.engine.generate,
                ids,
                params,
                f"{request_id}-{i}",
                priority=priority,
                lora_request=lora,
            )
            for i, ids in enumerate(prompts)
        ]
        gate = self.admission.gate()
        if gate is None or len(prompts) == 1:
            return [open_stream() for open_stream in streams]
        return [gate.stream(len(ids), s) for ids, s in zip(prompts, streams, strict=True)]

    async def _next_batch(
        self, merged: AsyncGenerator[Batch, None], started: float
    ) -> Batch | None:
        """The stream's next batch (None at its end); TimeoutError past the request timeout
        (counted from `started`)."""
        if self.request_timeout_s is None:
            return await anext(merged, None)
        left = started + self.request_timeout_s - time.monotonic()
        return await asyncio.wait_for(anext(merged, None), max(left, 0.0))


def _invalid(error: ValueError, constraint: str | None) -> ApiError:
    """A 400 for a refused request; the grammar compiler's refusal names the client's field."""
    message = str(error)
    prefix, _, reason = message.partition(": ")
    if constraint is None or not prefix.startswith("invalid structured_outputs."):
        return ApiError(400, message)
    return ApiError(400, f"invalid {constraint}: {reason}", constraint)
