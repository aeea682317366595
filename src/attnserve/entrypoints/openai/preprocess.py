"""`PreprocessPool`: the few threads that do a request's CPU-heavy preparation off the event loop
(decoding and validating a large JSON body, rendering the chat template, tokenizing, building
and checking the sampling parameters), so that the loop goes on answering `/health`, `/metrics`
and the streams in flight while one client sends the largest body the server takes.

At most `threads` jobs run at once; a caller past that waits on the loop (asynchronously) for a
slot, in arrival order. A large job (`LARGE_JOB_BYTES` of input or more) also needs one of
`threads - 1` large-job slots, so one thread always stays for small requests while large ones
queue. A job's slots are freed when its thread is done with it, not when its caller stops
waiting (a client that went away), so the bound holds for the threads' real work. The HF
tokenizers' encode releases the GIL while it runs in Rust; the template rendering and pydantic's
validation hold it, but give the loop its turn at each switch interval (5 ms).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from attnserve.config.frontend import DEFAULT_TOKENIZER_POOL_SIZE

P = ParamSpec("P")
T = TypeVar("T")

LARGE_JOB_BYTES = 256 << 10  # about 0.2 s of tokenizing


class PreprocessPool:
    def __init__(self, threads: int = DEFAULT_TOKENIZER_POOL_SIZE) -> None:
        if threads < 1:
            raise ValueError(f"the preprocessing pool needs at least one thread, not {threads}")
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="attnserve-preprocess")
        self._slots = asyncio.Semaphore(threads)
        self._large_slots = asyncio.Semaphore(max(1, threads - 1))

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a pool thread, once a slot is free; `size`: the bytes (or
        characters) of input it works on, which makes it a large job or not."""
        large = size >= LARGE_JOB_BYTES
        if large:
            await self._large_slots.acquire()
        try:
            await self._slots.acquire()
        except BaseException:
            if large:
                self._large_slots.release()
            raise
        job = asyncio.wrap_future(self._executor.submit(functools.partial(fn, *args, **kwargs)))
        job.add_done_callback(functools.partial(self._release, large))
        return await asyncio.shield(job)

    def _release(self, large: bool, job: asyncio.Future[Any]) -> None:
        self._slots.release()
        if large:
            self._large_slots.release()
        if not job.cancelled():
            job.exception()  # retrieved: the failure of a job whose caller left is not logged

    def shutdown(self) -> None:
        """No new jobs; the queued ones are dropped, the running ones finish on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
