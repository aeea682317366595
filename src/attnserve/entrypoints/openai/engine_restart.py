"""Restarting a dead engine core (`--restart-engine-core`): `EngineRestarter` starts new cores
until one serves, waiting longer after each one that fails, and gives up past
`--max-engine-core-restarts` in a row, so that a core that cannot stay up ends the server (exit
1, for its supervisor) instead of leaving it answering 503s for good.

Restarts are "in a row" while each new core fails to start or dies within RESTART_STABLE_S of
coming up; a core that served that long starts the count again. The first restart in a row
comes at once, the next after RESTART_BACKOFF_S, doubling up to RESTART_BACKOFF_MAX_S. Every
step is logged: the core's death (its pid and how it died, from `EngineDeadError`), each
attempt, its failure, the new core's pid, and giving up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from attnserve.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from attnserve.entrypoints.openai.metrics import ServerMetrics

logger = logging.getLogger(__name__)

RESTART_STABLE_S = 60.0  # a core that served this long starts the count of restarts in a row again
RESTART_BACKOFF_S = 1.0  # the wait before the second restart in a row; it doubles for each next
RESTART_BACKOFF_MAX_S = 30.0


class RestartPolicy:
    """How many restarts in a row so far, and the wait before the next one (None past
    `max_restarts`)."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.in_a_row = 0
        self.up_since: float | None = time.monotonic()  # None: the last start failed

    def next_delay(self) -> float | None:
        """After a core died (or did not start): the seconds to wait before starting the next
        one; None when that would be one restart in a row too many."""
        up_since = self.up_since
        if up_since is not None and time.monotonic() - up_since >= RESTART_STABLE_S:
            self.in_a_row = 0
        self.in_a_row += 1
        if self.in_a_row > self.max_restarts:
            return None
        if self.in_a_row == 1:
            return 0.0
        return min(RESTART_BACKOFF_S * 2 ** (self.in_a_row - 2), RESTART_BACKOFF_MAX_S)

    def started(self, ok: bool) -> None:
        """A new core came up (`ok`), or failed to."""
        self.up_since = time.monotonic() if ok else None


class EngineRestarter:
    """Restarts `engine`'s core after it died; `status` says what is going on meanwhile (for
    /health), None while the core serves."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, max_restarts: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.policy = RestartPolicy(max_restarts)
        self.status: str | None = None

    async def restart(self) -> bool:
        """New cores until one comes up (True, counted in `engine_core_restarts_total`); False
        once the restarts in a row are past the limit (logged, saying why)."""
        try:
            while (delay := self.policy.next_delay()) is not None:
                if await self._attempt(delay):
                    return True
            logger.error(
                "giving up: the engine core failed %d times in a row (each within %.0f s of "
                "its start; --max-engine-core-restarts %d); the last: %s",
                self.policy.in_a_row,
                RESTART_STABLE_S,
                self.policy.max_restarts,
                self.engine.error,
            )
            return False
        finally:
            self.status = None

    async def _attempt(self, delay: float) -> bool:
        attempt = f"attempt {self.policy.in_a_row} of {self.policy.max_restarts} in a row"
        self.status = f"the engine core is restarting ({attempt}) after: {self.engine.error}"
        logger.warning("restarting the engine core in %.0f s (%s)", delay, attempt)
        await asyncio.sleep(delay)
        try:
            await in_daemon_thread(self.engine.restart)
        except EngineDeadError as error:
            logger.error("the engine core restart failed (%s): %s", attempt, error)
            self.policy.started(ok=False)
            return False
        self.policy.started(ok=True)
        self.metrics.restarts.inc()
        pids = ", ".join(str(pid) for pid in self.engine.core_pids) or "in this process"
        logger.warning("the engine core restarted (pid %s): serving again", pids)
        return True


async def in_daemon_thread(call: Callable[[], None]) -> None:
    """`call()` in a daemon thread of its own, awaited: unlike the default executor's threads,
    one still loading a model cannot hold the process's exit up."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            call()
        except BaseException as raised:
            error = raised
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="attnserve-engine-restart", daemon=True).start()
    await done
