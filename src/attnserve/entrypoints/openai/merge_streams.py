"""The engine streams of one API call as one stream of batches: `one_stream` for a single
prompt, `merge_streams` for several (interleaved as their outputs arrive, each output's metrics
recorded on the way by its request's tracker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from attnserve.entrypoints.openai.metrics import RequestTracker
from attnserve.outputs import RequestOutput

Batch = list[tuple[int, RequestOutput]]  # (prompt index, output)


async def one_stream(
    stream: AsyncIterator[RequestOutput], tracker: RequestTracker
) -> AsyncGenerator[Batch, None]:
    """One prompt's outputs, read straight from the engine (which merges those queued behind a
    slow consumer)."""
    async with aclosing(stream):  # type: ignore[type-var]
        async for output in stream:
            tracker.observe(output)
            yield [(0, output)]


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]], trackers: list[RequestTracker]
) -> AsyncGenerator[Batch, None]:
    """Interleave the streams as their outputs arrive, every output waiting at once in one
    batch; leaving early cancels (aborts) them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        tracker = trackers[i]
        try:
            async for output in stream:
                tracker.observe(output)
                queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as error:  # handed to the consumer
            queue.put_nowait((i, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            waiting = [await queue.get()]
            while not queue.empty():
                waiting.append(queue.get_nowait())
            batch: Batch = []
            for i, item in waiting:
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    remaining -= 1
                else:
                    batch.append((i, item))
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
