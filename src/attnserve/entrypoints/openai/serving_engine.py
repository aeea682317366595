"""What both endpoints share: the model-name and field checks, prompt checks, `SamplingParams`
from a request, and the engine requests of one API call run as one stream of `Delta`s.

Prompts are tokenized here, so a prompt longer than the context, or one whose `max_tokens` does
not fit after it, is refused (400) before the engine sees it; so is a structured-output spec
that does not compile (the engine compiles it at submission). That work (templates, tokenizing,
the sampling parameters) runs on the server's `PreprocessPool` (`off_loop`), never on the event
loop; a text too long for the context however it is tokenized is refused before it is tokenized
(`check_length`). Every engine request is streamed as
deltas (the non-streaming endpoints add them up) with its metrics recorded; when the caller
stops reading (the client went away), every engine request of the call is aborted at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestEndedError
from attnserve.entrypoints.openai.admission import Admission
from attnserve.entrypoints.openai.errors import ApiError, error_body
from attnserve.entrypoints.openai.merge_streams import Batch, merge_streams, one_stream
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.preprocess import LARGE_JOB_BYTES, PreprocessPool
from attnserve.entrypoints.openai.prompt_bound import prompt_bound
from attnserve.entrypoints.openai.protocol import SamplingRequest
from attnserve.entrypoints.openai.request_fields import token_ids_out_of_range, unsupported_field
from attnserve.entrypoints.openai.sampling_defaults import (
    max_tokens_or_default,
    model_sampling_defaults,
    sampling_fields,
)
from attnserve.entrypoints.openai.serving_models import OpenAIServingModels
from attnserve.entrypoints.openai.structured import structured_outputs
from attnserve.lora.request import LoRARequest
from attnserve.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from attnserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
ResponseT = TypeVar("ResponseT", bound=BaseModel)


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


@dataclass
class Delta:
    """What is new in one choice (`index` counts over prompts x n) since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's, when asked for
    delivered: float = 0.0  # when its output reached the call (time.monotonic())


@dataclass
class Choice:
    """One choice's deltas added up (the non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs


LOGPROB_FLOOR = -9999.0


def finite(logprob: float | None) -> float:
    """A log-probability JSON can carry: -inf, NaN or a missing one become -9999 (as vLLM)."""
    if logprob is None or not math.isfinite(logprob):
        return LOGPROB_FLOOR
    return logprob


def top_k(candidates: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The `k` likeliest of one position's entries, likeliest first."""
    best = sorted(candidates.items(), key=lambda item: -item[1].logprob)[:k]
    return [(token, entry.logprob) for token, entry in best]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Chunks(Protocol):
    """A streamed call's chunks (`chunk_renderer.ChunkRenderer`)."""

    def render(self, deltas: list[Delta]) -> list[str]: ...

    def usage_chunk(self, tokens: int) -> str | None: ...


class OpenAIServing:
    request_timeout_s: float | None = None  # a request still running after this gets a 504
    log_requests = True  # per-request log lines (off: --disable-log-requests)

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        metrics: ServerMetrics,
        pool: PreprocessPool | None = None,
    ) -> None:
        """`pool`: the server's, shared by its endpoints (None: one of this endpoint's own)."""
        self.engine = engine
        self.model_name = model_name
        self.models = OpenAIServingModels(model_name, engine.engine.model_config.max_model_len)
        self.metrics = metrics
        self.admission = Admission()  # the server's own: set by `build_app`
        self.pool = pool or PreprocessPool()
        config = engine.engine.model_config
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        self.prompt_bound = prompt_bound(self.tokenizer)
        self.max_logprobs = engine.engine.processor.max_logprobs  # --max-logprobs
        self.scheduling_policy = engine.engine.config.scheduler_config.scheduling_policy
        self.default_sampling = model_sampling_defaults(config)  # --generation-config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, request: BaseModel) -> None:
        """404 for another model's name (a request's `model`); 400 for a field it refuses."""
        self.models.check(getattr(request, "model", None))  # the base model or an adapter
        refused = unsupported_field(request)
        if refused is not None:
            raise ApiError(400, refused[1], refused[0], "unsupported_parameter")

    def check_request(self, request: SamplingRequest, request_id: str) -> None:
        """`check_model`; 400 for stream options without a stream. Logs the `user` it names."""
        self.check_model(request)
        options = request.stream_options
        if options is not None and not request.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        if options is not None and options.continuous_usage_stats and not options.include_usage:
            message = "continuous_usage_stats needs include_usage: true"
            raise ApiError(400, message, "stream_options.continuous_usage_stats")
        if request.user is not None and self.log_requests:
            logger.info("%s for user %r", request_id, request.user)

    async def off_loop(
        self, raw: Request, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`fn(*args, **kwargs)` on the preprocessing pool, as a job the size of the request's
        body (a body of unknown length counts as large)."""
        length = raw.headers.get("content-length", "")
        size = int(length) if length.isdigit() else LARGE_JOB_BYTES
        return await self.pool.run(size, fn, *args, **kwargs)

    def check_length(self, text: str, param: str) -> None:
        """400 (without tokenizing it) for a text too long for the context however the
        tokenizer splits it (see `prompt_bound`)."""
        bound = self.prompt_bound
        if bound is None or not bound.cannot_fit(text, self.max_model_len - 1):
            return
        raise ApiError(
            400,
            f"the prompt has {len(text)} characters, more than {self.max_model_len - 1} tokens "
            f"of this model can hold (one stands for {bound.chars_per_token} characters at "
            f"most); this model's maximum context length is {self.max_model_len} tokens, which "
            "must leave room for one generated token",
            param,
            "context_length_exceeded",
        )

    def encode(self, text: str, param: str, truncating: bool = False) -> list[int]:
        """The text's token ids (a text that cannot fit the context is refused first, unless
        `truncating`: the caller keeps only its last tokens)."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param)
        if not truncating:
            self.check_length(text, param)
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which must leave room for one generated token",
                param,
                "context_length_exceeded",
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(400, f"token ids must be in 0..{self.vocab_size - 1}", param)

    def sampling_params(
        self,
        request: SamplingRequest,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams` (400 for what they refuse); `max_tokens` None: the
        rest of the context; `tool_constraint`: the output's, from its tool_choice."""
        room = self.max_model_len - prompt_len
        max_tokens = max_tokens_or_default(request, self.default_sampling, max_tokens, room)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens: the prompt "
                f"has {prompt_len} and max_tokens asks for {max_tokens}",
                "max_tokens",
                "context_length_exceeded",
            )
        out_of_range = token_ids_out_of_range(request, self.vocab_size)
        if out_of_range is not None:
            raise ApiError(400, out_of_range[1], out_of_range[0])
        constraint = structured_outputs(request)
        if constraint is not None and tool_constraint is not None:
            message = "tool_choice constrains the output already: no response_format with it"
            raise ApiError(400, message, "tool_choice")
        try:
            return SamplingParams(
                n=request.n,
                best_of=best_of,
                **sampling_fields(request, self.default_sampling),
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                logit_bias=request.logit_bias,
                seed=request.seed,
                max_tokens=room if max_tokens is None else max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids or [],
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=constraint or tool_constraint,
            )
        except ValueError as error:
            raise ApiError(400, str(error)) from error

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text: str = self.tokenizer.decode([token_id])
        return text

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        received: float,
        constraint: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[list[Delta], None]:
        """Each engine output of the call's prompts, as deltas; ApiError for a failure (a
        constraint the compiler refuses is named by `constraint`, the field it came from).
        `received`: when the call's handler started (time.monotonic()); the prompts are ready
        now. `priority`: the engine requests' (lower runs earlier); `lora_request`: their
        LoRA adapter."""
        times = (received, time.monotonic())
        engine_request = (priority, lora_request)
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

    async def sse(
        self,
        first: list[Delta],
        stream: AsyncGenerator[list[Delta], None],
        render: Callable[[list[Delta]], Iterable[str]],
        final: Callable[[int], str | None],
    ) -> AsyncIterator[str]:
        """Server-sent events: `render`'s chunks for each batch of deltas (written at once),
        `final(tokens)` (the usage chunk, if asked for), an error event if the engine fails,
        then `[DONE]`."""
        tokens = 0
        breakdown = self.metrics.breakdown
        try:
            async with aclosing(stream):
                deltas: list[Delta] | None = first
                while deltas is not None:
                    tokens += sum(len(d.token_ids) for d in deltas)
                    yield "".join(_event(chunk) for chunk in render(deltas))
                    # (resumed once the chunk is handed to the socket)
                    if deltas:
                        breakdown.written(deltas[0].delivered, time.monotonic(), deltas is first)
                    deltas = await anext(stream, None)
            tail = final(tokens)
            if tail is not None:
                yield _event(tail)
        except ApiError as error:
            yield _event(error_body(error.status, error.message, error.param, error.code))
        yield _event("[DONE]")

    async def respond(
        self,
        raw: Request,
        stream: AsyncGenerator[list[Delta], None],
        chunks: Chunks | None,
        num_choices: int,
        build: Callable[[list[Choice], int], ResponseT],
    ) -> ResponseT | StreamingResponse:
        """The call's answer: with `chunks`, the stream as server-sent events; else, once every
        choice is done, `build(choices, generated tokens)`."""
        if chunks is not None:
            first = await until_disconnect(raw, anext(stream))
            events = self.sse(first, stream, chunks.render, chunks.usage_chunk)
            return StreamingResponse(events, media_type="text/event-stream")
        choices, tokens = await until_disconnect(raw, self.collect(stream, num_choices))
        return build(choices, tokens)

    async def collect(
        self, stream: AsyncIterator[list[Delta]], num_choices: int
    ) -> tuple[list[Choice], int]:
        """Every delta of `stream` added up per choice, and the number of generated tokens."""
        choices = [Choice() for _ in range(num_choices)]
        async for deltas in stream:
            for delta in deltas:
                choices[delta.index].add(delta)
        return choices, sum(len(c.token_ids) for c in choices)


def _invalid(error: ValueError, constraint: str | None) -> ApiError:
    """A 400 for a refused request; the grammar compiler's refusal names the client's field."""
    message = str(error)
    prefix, _, reason = message.partition(": ")
    if constraint is None or not prefix.startswith("invalid structured_outputs."):
        return ApiError(400, message)
    return ApiError(400, f"invalid {constraint}: {reason}", constraint)


def _event(data: str) -> str:
    return f"data: {data}\n\n"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnected (with `work` cancelled) if the client goes first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientDisconnected
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
