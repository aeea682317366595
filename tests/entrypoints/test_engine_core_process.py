"""`attnserve serve` with its engine core in a process of its own (the default), on the tiny
dummy preset: /health only after the warm-up; a killed engine core fails the requests in flight
with OpenAI error objects (an error event then [DONE] mid-stream, a 5xx error JSON otherwise),
then the server exits 1 by itself, leaving no process behind; SIGTERM with a stream in flight
drains it (the stream ends whole or with an error event and [DONE]) and exits 0; two engine
cores (--data-parallel-size 2) give one in-process core's greedy tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from attnserve import LLM, SamplingParams
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import ServerProcess, is_running

TINY = ["llama-tiny", "--load-format", "dummy", "--device", "cpu", "--max-model-len", "1024"]
LONG: dict[str, Any] = {"prompt": [5, 6, 7, 8], "max_tokens": 900, "ignore_eos": True}


def _running(server: ServerProcess) -> float:
    return server.metrics()["attnserve:num_requests_running"]


async def _until(condition: Any) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "hang guard"
        await asyncio.sleep(0.05)


def _events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def _assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while any(is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"left behind: {[p for p in pids if is_running(p)]}"
        time.sleep(0.05)


def test_the_engine_core_is_a_process_of_its_own_that_imports_no_server() -> None:
    """What the core process imports (its module's import closure): no web stack, no output
    processing (detokenizing, stop strings)."""
    probe = (
        "import sys, attnserve.engine.core.loop\n"
        "banned = ('fastapi', 'uvicorn', 'starlette', 'pydantic', 'httpx', 'prometheus_client',"
        " 'attnserve.entrypoints', 'attnserve.engine.output_processor',"
        " 'attnserve.engine.async_llm_engine', 'attnserve.engine.llm_engine')\n"
        "print(sorted(m for m in sys.modules if m.startswith(banned)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_killed_engine_core_fails_requests_and_health_then_sigterm_leaves_nothing() -> None:
    server = ServerProcess(TINY)
    children = server.children()
    try:
        health = httpx.get(server.url + "/health", timeout=HANG_GUARD_S)
        assert health.status_code == 200  # warmed up
        (core,) = server.engine_core_pids()

        async def run() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
                whole = asyncio.create_task(http.post("/v1/completions", json=LONG))
                async with http.stream(
                    "POST", "/v1/completions", json={**LONG, "stream": True}
                ) as stream:
                    lines = stream.aiter_lines()
                    first = await anext(lines)
                    await _until(lambda: _running(server) == 2)
                    os.kill(core, signal.SIGKILL)
                    rest = [line async for line in lines]
                return _events("\n".join([first, *rest])), await whole

        events, whole = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S * 2))
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and "SIGKILL" in error["message"]
        assert error["message"].count("the engine has failed") == 1
        assert all("choices" in json.loads(e) for e in events[:-2])
        assert whole.status_code == 503
        assert whole.json()["error"]["type"] == "service_unavailable"
        # then the server exits non-zero by itself, so that a supervisor starts it again
        assert server.proc.wait(timeout=HANG_GUARD_S) == 1
        assert "Traceback" not in server.log_text()
    finally:
        server.stop()
    _assert_all_gone(children)


def test_sigterm_with_streams_in_flight_stops_cleanly() -> None:
    server = ServerProcess(TINY)
    children = server.children()
    assert server.engine_core_pids()

    async def run() -> list[str]:
        body = {**LONG, "stream": True}
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http,
            http.stream("POST", "/v1/completions", json=body) as stream,
        ):
            lines = stream.aiter_lines()
            received = [await anext(lines)]
            server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(httpx.HTTPError):  # the server may close the connection
                received += [line async for line in lines]
            return received

    received = asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S * 2))
    assert server.proc.wait(timeout=HANG_GUARD_S) == 0  # drained
    assert _events("\n".join(received))[-1] == "[DONE]"  # whole, or an error event then [DONE]
    log = server.log_text()
    assert "engine core stops" not in log  # it was told to stop, not orphaned
    assert "Traceback" not in log
    server.stop()
    _assert_all_gone(children)


def test_data_parallel_serve_matches_one_in_process_core() -> None:
    prompts = [[(13 * i + 7 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(8)]
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", max_model_len=1024)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.shutdown()
    server = ServerProcess([*TINY, "--data-parallel-size", "2"])
    children = server.children()
    try:
        assert len(server.engine_core_pids()) == 2

        async def one(http: httpx.AsyncClient, prompt: list[int]) -> list[int]:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            response = await http.post("/v1/completions", json={**body, "logprobs": 0})
            tokens = response.json()["choices"][0]["logprobs"]["tokens"]
            return [int(t.removeprefix("token_id:")) for t in tokens]

        async def run() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        assert asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S * 2)) == expected
        assert server.wait_idle()["attnserve:kv_cache_usage_perc"] == 0
    finally:
        server.stop()
    _assert_all_gone(children)
