"""The server's restart and stop logic without a server (a stand-in engine): restarts in a row
and their waits (`RestartPolicy`), `EngineRestarter` retrying a core that did not start,
counting the restart that worked and naming the current failure meanwhile, and giving up past
the limit; `ServerLifecycle`'s signals (drain, end now with exit 128 + the signal, stop at
once) and its exit code 1 for a server that stops with a dead engine core. The same against a
real server: tests/entrypoints/test_server_lifecycle.py."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any, cast

import pytest

from attnserve.engine.async_llm_engine import EngineDeadError
from attnserve.entrypoints.openai import engine_restart
from attnserve.entrypoints.openai.engine_restart import (
    RESTART_BACKOFF_MAX_S,
    RESTART_BACKOFF_S,
    RESTART_STABLE_S,
    EngineRestarter,
    RestartPolicy,
)
from attnserve.entrypoints.openai.lifecycle import ServerLifecycle
from attnserve.entrypoints.openai.metrics import ServerMetrics
from tests.conftest import HANG_GUARD_S, wait_until

DIED = "the engine core process (pid 10) died (killed by SIGKILL)"


class FakeEngine:
    """An engine whose core is dead; `restart` fails `failures` times (after `gate` opens)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.error: EngineDeadError | None = EngineDeadError(DIED)
        self.gate = threading.Event()
        self.gate.set()
        self.core_pids = [11]
        self.ended: list[str] = []

    @property
    def errored(self) -> bool:
        return self.error is not None

    def restart(self) -> None:
        assert self.gate.wait(HANG_GUARD_S), "hang guard"
        if self.failures:
            self.failures -= 1
            self.error = EngineDeadError("a new engine core did not start: killed by SIGKILL")
            raise self.error
        self.error = None

    def end_all(self, reason: str) -> None:
        self.ended.append(reason)

    def stats(self) -> dict[str, float]:
        raise EngineDeadError(DIED)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _restarts(metrics: ServerMetrics) -> str:
    lines = metrics.render().decode().splitlines()
    return next(line for line in lines if line.startswith("attnserve:engine_core_restarts_total"))


def test_restarts_in_a_row_wait_longer_each_time_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(engine_restart.time, "monotonic", clock)
    policy = RestartPolicy(max_restarts=8)
    delays = []
    for _ in range(8):
        delays.append(policy.next_delay())
        policy.started(ok=False)
    backoff = [RESTART_BACKOFF_S * 2**k for k in range(6)]
    assert delays == [0.0, *(min(d, RESTART_BACKOFF_MAX_S) for d in backoff), RESTART_BACKOFF_MAX_S]
    assert policy.next_delay() is None  # the ninth in a row


def test_a_core_that_served_a_while_starts_the_count_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(engine_restart.time, "monotonic", clock)
    policy = RestartPolicy(max_restarts=2)
    assert policy.next_delay() == 0.0
    policy.started(ok=True)
    clock.now += RESTART_STABLE_S - 1  # died soon after coming up: in a row
    assert policy.next_delay() == RESTART_BACKOFF_S
    policy.started(ok=True)
    clock.now += RESTART_STABLE_S  # served a minute: the count starts again
    assert policy.next_delay() == 0.0
    policy.started(ok=False)  # a core that did not start is in a row, however long it took
    clock.now += 10 * RESTART_STABLE_S
    assert policy.next_delay() == RESTART_BACKOFF_S
    assert policy.next_delay() is None
    assert RestartPolicy(max_restarts=0).next_delay() is None


def _restarter(engine: FakeEngine, max_restarts: int) -> tuple[EngineRestarter, ServerMetrics]:
    metrics = ServerMetrics(engine.stats, lambda: not engine.errored)
    return EngineRestarter(cast(Any, engine), metrics, max_restarts), metrics


def test_a_core_that_does_not_start_is_tried_again_and_the_status_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine_restart, "RESTART_BACKOFF_S", 0.0)
    caplog.set_level(logging.INFO, logger=engine_restart.__name__)
    engine = FakeEngine(failures=2)
    restarter, metrics = _restarter(engine, max_restarts=5)

    async def run() -> tuple[bool, list[str]]:
        statuses = [""]
        task = asyncio.create_task(restarter.restart())
        for _ in range(3):  # each attempt held in its restart() while its status is read
            engine.gate.clear()
            await asyncio.to_thread(
                wait_until, lambda: restarter.status not in (None, statuses[-1]), "the status"
            )
            statuses.append(restarter.status or "")
            engine.gate.set()
        return await task, statuses[1:]

    restarted, statuses = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert restarted and restarter.status is None and engine.error is None
    assert DIED in statuses[0] and "attempt 1 of 5" in statuses[0]
    assert "did not start" in statuses[2] and "attempt 3 of 5" in statuses[2]  # the current one
    assert _restarts(metrics).endswith(" 1.0")  # the one that worked
    log = caplog.text
    assert log.count("the engine core restart failed") == 2
    assert "the engine core restarted (pid 11)" in log


def test_past_the_limit_the_restarter_gives_up_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine_restart, "RESTART_BACKOFF_S", 0.0)
    engine = FakeEngine(failures=10)
    restarter, metrics = _restarter(engine, max_restarts=2)
    assert not asyncio.run(asyncio.wait_for(restarter.restart(), HANG_GUARD_S))
    assert engine.failures == 8 and _restarts(metrics).endswith(" 0.0")
    assert "giving up" in caplog.text and "--max-engine-core-restarts 2" in caplog.text


class FakeServer:
    should_exit = False
    force_exit = False


def _lifecycle(engine: FakeEngine) -> tuple[ServerLifecycle, FakeServer]:
    metrics = ServerMetrics(engine.stats, lambda: not engine.errored)
    lifecycle = ServerLifecycle(cast(Any, engine), metrics, shutdown_timeout_s=HANG_GUARD_S)
    server = FakeServer()
    lifecycle.server = cast(Any, server)
    return lifecycle, server


def test_signals_drain_then_end_everything_then_stop_at_once() -> None:
    engine = FakeEngine()
    engine.error = None
    lifecycle, server = _lifecycle(engine)

    async def run() -> None:
        lifecycle.in_flight = 1
        lifecycle.on_signal(signal.SIGINT)
        assert lifecycle.draining and not engine.ended and not server.should_exit
        lifecycle.on_signal(signal.SIGINT)
        assert engine.ended == ["the server is shutting down now (a second SIGINT)"]
        lifecycle.in_flight = 0  # the ended request's answer went out
        await asyncio.to_thread(wait_until, lambda: server.should_exit, "the server stopped")
        assert not server.force_exit
        lifecycle.on_signal(signal.SIGINT)
        assert server.force_exit

    asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert lifecycle.exit_code == 128 + signal.SIGINT


def test_a_server_that_stops_with_its_engine_core_dead_exits_1() -> None:
    lifecycle, server = _lifecycle(FakeEngine())  # died, not yet seen by the watch

    async def run() -> None:
        lifecycle.on_signal(signal.SIGTERM)
        await asyncio.to_thread(wait_until, lambda: server.should_exit, "the server stopped")

    asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert lifecycle.exit_code == 1
