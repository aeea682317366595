"""How a call's deltas reach its client: streamed as server-sent events (`sse`), or added up per
choice into one response once every choice is done (`collect`); `respond` picks between them.
While the call waits, a client that goes away (`until_disconnect`) cancels the wait and so every
engine request of the call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.entrypoints.openai.chunk_renderer import ChunkRenderer
from attnserve.entrypoints.openai.deltas import Choice, Delta
from attnserve.entrypoints.openai.errors import ApiError, error_body
from attnserve.entrypoints.openai.latency_breakdown import LatencyBreakdown

T = TypeVar("T")
ResponseT = TypeVar("ResponseT", bound=BaseModel)


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def respond(
    raw: Request,
    stream: AsyncGenerator[list[Delta], None],
    chunks: ChunkRenderer[Any] | None,
    num_choices: int,
    build: Callable[[list[Choice], int], ResponseT],
    breakdown: LatencyBreakdown,
) -> ResponseT | StreamingResponse:
    """The call's answer: with `chunks`, the stream as server-sent events (their writes timed
    in `breakdown`); else, once every choice is done, `build(choices, generated tokens)`."""
    if chunks is not None:
        first = await until_disconnect(raw, anext(stream))
        events = sse(first, stream, chunks.render, chunks.usage_chunk, breakdown)
        return StreamingResponse(events, media_type="text/event-stream")
    choices, tokens = await until_disconnect(raw, collect(stream, num_choices))
    return build(choices, tokens)


async def sse(
    first: list[Delta],
    stream: AsyncGenerator[list[Delta], None],
    render: Callable[[list[Delta]], Iterable[str]],
    final: Callable[[int], str | None],
    breakdown: LatencyBreakdown,
) -> AsyncIterator[str]:
    """Server-sent events: `render`'s chunks for each batch of deltas (written at once),
    `final(tokens)` (the usage chunk, if asked for), an error event if the engine fails,
    then `[DONE]`."""
    tokens = 0
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


async def collect(stream: AsyncIterator[list[Delta]], num_choices: int) -> tuple[list[Choice], int]:
    """Every delta of `stream` added up per choice, and the number of generated tokens."""
    choices = [Choice() for _ in range(num_choices)]
    async for deltas in stream:
        for delta in deltas:
            choices[delta.index].add(delta)
    return choices, sum(len(c.token_ids) for c in choices)


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
