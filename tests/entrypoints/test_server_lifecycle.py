"""The server in operation, on the tiny dummy preset with its engine core in its own process: a
hung (stopped) core is seen and ended; SIGTERM drains (503 for new work, in-flight requests
finish, or end with an error past --shutdown-timeout) and exits 0 without a traceback, and a
second SIGINT ends the streams with an error event at once and exits 130; with
--restart-engine-core a core killed twice in a row (the second as it starts) is replaced, and
one that keeps dying past --max-engine-core-restarts ends the server with exit code 1;
--request-timeout and --request-read-timeout bound a request; API keys (any case of the scheme,
a challenge on 401, from a file, refused absence on a public address, refused empty keys);
/metrics without the warm-up, and once the core is gone. Every wait polls with a bound."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.config.frontend import FrontendArgs, resolve_api_key
from attnserve.engine.core_client import EngineDeadError
from attnserve.entrypoints.openai.metrics import ServerMetrics
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import ServerProcess, is_running

TINY = ["llama-tiny", "--load-format", "dummy", "--device", "cpu", "--max-model-len", "1024"]
LONG: dict[str, Any] = {"prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True}


def _events(lines: list[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _poll(condition: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"hang guard: {what}"
        time.sleep(0.05)


def _status(url: str, path: str = "/health") -> int | None:
    """The status of GET url+path; None once the server is gone."""
    try:
        return httpx.get(url + path, timeout=HANG_GUARD_S).status_code
    except httpx.HTTPError:
        return None


async def _stream(http: httpx.AsyncClient, started: asyncio.Event | None = None) -> list[str]:
    """One streamed LONG completion's events, to its end (or the connection's)."""
    lines: list[str] = []
    try:
        body = {**LONG, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if started is not None:
                    started.set()
    except httpx.HTTPError:
        pass
    return _events(lines)


def _completed(events: list[str]) -> bool:
    """The stream ended whole: its usage chunk (all 1,000 tokens), then [DONE]."""
    if len(events) < 2 or events[-1] != "[DONE]":
        return False
    usage = json.loads(events[-2]).get("usage") or {}
    return bool(usage.get("completion_tokens") == LONG["max_tokens"])


def _ended_properly(events: list[str]) -> bool:
    """A stream that finished whole, or with an error event just before [DONE]."""
    if _completed(events):
        return True
    return len(events) > 1 and events[-1] == "[DONE]" and "error" in json.loads(events[-2])


def test_a_stopped_engine_core_is_found_hung_and_ends_the_requests() -> None:
    server = ServerProcess(TINY)
    try:
        (core,) = server.engine_core_pids()

        async def run() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream(http, started))
                await started.wait()
                os.kill(core, signal.SIGSTOP)
                health = await asyncio.to_thread(_poll_health_down, server.url)
                assert health in (503, None)
                return await stream

        events = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
        assert events[-1] == "[DONE]" and "hung" in json.loads(events[-2])["error"]["message"]
        assert server.proc.wait(timeout=HANG_GUARD_S) == 1  # then it exits for a restart
        _poll(lambda: not is_running(core), "the hung core killed")
    finally:
        server.stop()


def _poll_health_down(url: str) -> int | None:
    status = _status(url)
    deadline = time.monotonic() + HANG_GUARD_S
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
        status = _status(url)
    return status


def test_sigterm_lets_a_request_in_flight_finish_and_refuses_new_ones() -> None:
    server = ServerProcess(TINY)

    async def run() -> tuple[list[str], int | None, int | None]:
        async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(http, started))
            await started.wait()
            server.proc.send_signal(signal.SIGTERM)
            health = await asyncio.to_thread(_poll_health_down, server.url)
            refused = await http.post("/v1/completions", json=LONG)
            return await stream, health, refused.status_code

    events, health, refused = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert health == 503 and refused == 503  # draining, with the stream still in flight
    assert _completed(events)  # all 1,000 tokens, then [DONE]
    assert server.proc.wait(timeout=HANG_GUARD_S) == 0
    assert "Traceback" not in server.log_text()
    server.stop()


def test_past_the_shutdown_timeout_eight_streams_end_with_an_error_and_done() -> None:
    server = ServerProcess([*TINY, "--shutdown-timeout", "0.5"])

    async def run() -> tuple[list[list[str]], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.create_task(_stream(http, event)) for event in started]
            whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
            for event in started:
                await event.wait()
            server.proc.send_signal(signal.SIGTERM)
            return list(await asyncio.gather(*streams)), await whole

    streams, whole = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    assert all(_ended_properly(events) for events in streams), [s[-2:] for s in streams]
    assert any("error" in json.loads(events[-2]) for events in streams)
    assert whole.status_code in (200, 503)
    if whole.status_code == 503:
        assert "shutting down" in whole.json()["error"]["message"]
    assert server.proc.wait(timeout=HANG_GUARD_S) == 0
    assert "Traceback" not in server.log_text()
    server.stop()


def _kill_twice(server: ServerProcess) -> tuple[int, int]:
    """Kill the engine core, then the new one as soon as it is there (while it starts up, as a
    rule): the two pids."""
    (core,) = server.engine_core_pids()
    os.kill(core, signal.SIGKILL)
    new_cores: list[int] = []

    def new_core_started() -> bool:
        new_cores[:] = [pid for pid in server.engine_core_pids() if pid != core]
        return bool(new_cores)

    _poll(new_core_started, "a new engine core started")
    os.kill(new_cores[0], signal.SIGKILL)
    return core, new_cores[0]


def test_a_core_killed_twice_in_a_row_is_replaced_with_restart_engine_core() -> None:
    server = ServerProcess([*TINY, "--restart-engine-core"])
    try:
        ready = server.metrics()  # the warm-up's prefix-cache hits count in no metric
        assert ready["attnserve:prefix_cache_hit_rate"] == 0
        assert ready["attnserve:num_preemptions_total"] == 0
        first, second = _kill_twice(server)
        _poll(lambda: _status(server.url) == 200, "healthy again")
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        (serving,) = server.engine_core_pids()
        assert serving not in (first, second) and server.metrics()["attnserve:engine_healthy"] == 1
        log = server.log_text()
        assert f"pid {first}) died (killed by SIGKILL)" in log
        assert f"pid {second})" in log and "restarting the engine core" in log
        assert f"the engine core restarted (pid {serving})" in log
        restarts = server.metrics()["attnserve:engine_core_restarts_total"]
        assert restarts == log.count("the engine core restarted (pid")  # those that worked
    finally:
        assert server.stop() == 0


def test_a_core_that_keeps_dying_ends_the_server_with_exit_code_1() -> None:
    server = ServerProcess([*TINY, "--restart-engine-core", "--max-engine-core-restarts", "1"])
    try:
        _kill_twice(server)
        assert server.proc.wait(timeout=HANG_GUARD_S) == 1
        log = server.log_text()
        assert "giving up" in log and "--max-engine-core-restarts 1" in log
        assert "Traceback" not in log
    finally:
        server.stop()


def test_a_second_sigint_ends_the_streams_with_an_error_and_exits_130() -> None:
    server = ServerProcess(TINY)

    async def run() -> tuple[list[list[str]], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(_stream(http, event)) for event in started]
            whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
            for event in started:
                await event.wait()
            server.proc.send_signal(signal.SIGINT)
            assert await asyncio.to_thread(_poll_health_down, server.url) == 503  # draining
            server.proc.send_signal(signal.SIGINT)
            return list(await asyncio.gather(*streams)), await whole

    streams, whole = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
    for events in streams:
        assert (
            events[-1] == "[DONE]"
            and "a second SIGINT" in json.loads(events[-2])["error"]["message"]
        )
    assert whole.status_code == 503 and "a second SIGINT" in whole.json()["error"]["message"]
    assert server.proc.wait(timeout=HANG_GUARD_S) == 128 + signal.SIGINT
    assert "Traceback" not in server.log_text()
    server.stop()


def test_request_timeout_ends_long_requests_with_504() -> None:
    server = ServerProcess([*TINY, "--request-timeout", "0.3"])
    try:
        whole = httpx.post(server.url + "/v1/completions", json=LONG, timeout=HANG_GUARD_S)
        assert whole.status_code == 504 and whole.json()["error"]["type"] == "timeout_error"

        async def run() -> list[str]:
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
                return await _stream(http)

        events = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))
        assert events[-1] == "[DONE]" and "request-timeout" in events[-2]
        metrics = server.wait_idle()
        assert metrics['attnserve:request_failure_total{reason="timeout"}'] == 2
        assert metrics["attnserve:kv_cache_usage_perc"] == 0  # both aborted, blocks freed
    finally:
        server.stop()


def test_half_sent_requests_are_cut_off() -> None:
    server = ServerProcess([*TINY, "--request-read-timeout", "0.5"])
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
            assert sock.recv(1024) == b""  # closed by the server
        with socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S) as sock:
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"prompt": [1')
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408")
        assert _status(server.url) == 200  # the server itself is fine
    finally:
        server.stop()


def test_api_key_scheme_is_case_insensitive_and_401_challenges(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    server = ServerProcess([*TINY, "--api-key-file", str(key_file)])
    try:
        models = server.url + "/v1/models"
        for scheme in ("Bearer", "bearer", "BEARER"):
            headers = {"Authorization": f"{scheme} s3cret"}
            assert httpx.get(models, headers=headers, timeout=HANG_GUARD_S).status_code == 200
        refused = httpx.get(models, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert httpx.get(models, timeout=HANG_GUARD_S).status_code == 401
    finally:
        server.stop()


def _args(**given: Any) -> FrontendArgs:
    return FrontendArgs(**given)


def test_api_key_sources_and_a_public_address_without_one(tmp_path: Path) -> None:
    assert resolve_api_key(_args(), {}) is None
    assert resolve_api_key(_args(), {"ATTNSERVE_API_KEY": "env"}) == "env"
    assert resolve_api_key(_args(api_key="flag"), {"ATTNSERVE_API_KEY": "env"}) == "flag"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        resolve_api_key(_args(api_key_file=str(empty)), {})
    with pytest.raises(ValueError, match="No such file"):
        resolve_api_key(_args(api_key_file=str(tmp_path / "missing")), {})
    with pytest.raises(ValueError, match="give the API key once"):
        resolve_api_key(_args(api_key="a", api_key_file=str(empty)), {})
    with pytest.raises(ValueError, match="--allow-no-api-key"):
        resolve_api_key(_args(host="0.0.0.0"), {})
    assert resolve_api_key(_args(host="0.0.0.0", allow_no_api_key=True), {}) is None
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="--api-key is empty"):
            resolve_api_key(_args(api_key=blank), {})
        with pytest.raises(ValueError, match="ATTNSERVE_API_KEY is set but empty"):
            resolve_api_key(_args(), {"ATTNSERVE_API_KEY": blank})
    assert resolve_api_key(_args(api_key="flag"), {"ATTNSERVE_API_KEY": ""}) == "flag"


@pytest.mark.parametrize(
    ("flags", "said"),
    [(["--host", "0.0.0.0"], "--allow-no-api-key"), (["--api-key", ""], "--api-key is empty")],
)
def test_serve_refuses_a_key_setup_that_serves_without_one_before_loading(
    flags: list[str], said: str
) -> None:
    command = [sys.executable, "-m", "attnserve.cli", "serve", *TINY, *flags]
    env = {k: v for k, v in os.environ.items() if k != "ATTNSERVE_API_KEY"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert result.returncode == 2 and said in result.stderr
    assert "Traceback" not in result.stderr


def test_metrics_of_a_dead_engine_read_idle_and_unhealthy() -> None:
    live = {
        "num_running": 3, "num_waiting": 2, "num_swapped": 1, "kv_cache_usage": 0.5,
        "prefix_cache_hit_rate": 0.25, "num_preemptions": 4,
    }  # fmt: skip
    healthy = [True]

    def stats() -> dict[str, float]:
        if not healthy[0]:
            raise EngineDeadError("gone")
        return live

    metrics = ServerMetrics(stats, lambda: healthy[0])
    text = metrics.render().decode()
    assert "attnserve:num_requests_running 3.0" in text and "attnserve:engine_healthy 1.0" in text
    healthy[0] = False
    text = metrics.render().decode()
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"attnserve:{gauge} 0.0" in text
    assert "attnserve:engine_healthy 0.0" in text
    assert "attnserve:num_preemptions_total 4.0" in text  # a counter keeps its count
    assert 'attnserve:request_failure_total{reason="engine_failed"} 0.0' in text
