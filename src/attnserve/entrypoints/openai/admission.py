"""Admission control: what the server takes in before the engine's scheduler sees it.

- A bounded queue: a generation request counts as queued from the moment it is admitted until
  its first output (it waits in the engine, or at its prompt gate). Past `max_queued_requests`
  (SGLang's `--max-queued-requests`) a new one gets 503 with `Retry-After` (an estimate from the
  rate at which queued requests got their first output lately), counted in
  `attnserve:request_rejected_total{reason="queue_full"}`.
- A per-request share of prompt tokens (`PromptGate`): the prompts of one request (a
  completion's list of prompts) enter the engine while the prompt tokens it has there stay within
  `max_request_prompt_tokens_in_flight`, one prompt at least; the rest wait, in the front end,
  until one of its prompts finishes. So one request of 64 long prompts cannot take the whole KV
  cache from everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from attnserve.config.frontend import DEFAULT_MAX_QUEUED_REQUESTS
from attnserve.entrypoints.openai.errors import ApiError

T = TypeVar("T")

RECENT_STARTS = 64  # first outputs the Retry-After estimate is taken over
MAX_RETRY_AFTER_S = 60


class Admission:
    """The server's queue bound and per-request prompt-token share (the module docstring)."""

    def __init__(
        self,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        max_request_prompt_tokens_in_flight: int | None = None,
        on_reject: Callable[[], None] = lambda: None,
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_request_prompt_tokens = max_request_prompt_tokens_in_flight
        self.on_reject = on_reject
        self.num_queued = 0
        self._starts: deque[float] = deque(maxlen=RECENT_STARTS)

    def admit(self) -> Ticket:
        """A ticket for one more queued request; ApiError 503 with Retry-After past the bound."""
        if self.num_queued >= self.max_queued_requests:
            self.on_reject()
            raise ApiError(
                503,
                f"the server has {self.num_queued} requests queued (--max-queued-requests "
                f"{self.max_queued_requests}): retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s())},
            )
        self.num_queued += 1
        return Ticket(self)

    def retry_after_s(self) -> int:
        """Seconds for the queue to drain at the rate its requests started lately (1 s to
        MAX_RETRY_AFTER_S)."""
        starts = self._starts
        span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
        if span <= 0:
            return 1
        rate = (len(starts) - 1) / span
        return min(max(math.ceil(self.num_queued / rate), 1), MAX_RETRY_AFTER_S)

    def gate(self) -> PromptGate | None:
        """One request's prompt gate (None: no per-request share)."""
        limit = self.max_request_prompt_tokens
        return None if limit is None else PromptGate(limit)

    def _leave(self, started: bool) -> None:
        self.num_queued -= 1
        if started:
            self._starts.append(time.monotonic())


class Ticket:
    """One queued request's place: `leave` once its first output has come (`started`) or it
    has ended without one; only the first call counts."""

    def __init__(self, admission: Admission) -> None:
        self.admission: Admission | None = admission

    def leave(self, started: bool) -> None:
        if self.admission is not None:
            self.admission._leave(started)
            self.admission = None


class PromptGate:
    """One request's prompts in the engine, by prompt tokens: a prompt enters while the ones
    inside hold at most `limit` tokens with it, or when none is inside."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._released = asyncio.Event()

    @contextlib.asynccontextmanager
    async def hold(self, tokens: int) -> AsyncIterator[None]:
        while self.held and self.held + tokens > self.limit:
            released = self._released
            await released.wait()
        self.held += tokens
        try:
            yield
        finally:
            self.held -= tokens
            self._released.set()
            self._released = asyncio.Event()

    async def stream(
        self, tokens: int, open_stream: Callable[[], AsyncIterator[T]]
    ) -> AsyncGenerator[T, None]:
        """`open_stream()`'s items, opened once this gate lets `tokens` prompt tokens in."""
        async with self.hold(tokens), contextlib.aclosing(open_stream()) as stream:  # type: ignore[type-var]
            async for item in stream:
                yield item
