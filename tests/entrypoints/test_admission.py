"""Admission and fairness (issue 48): the server's bounded queue (503 with Retry-After, counted
in /metrics), one request's prompts sharing a prompt-token budget, and a short request started
within two scheduler steps while a 96k-token request is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import httpx
import pytest

from attnserve.config import FrontendArgs
from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.api_server import build_app
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams
from tests.conftest import HANG_GUARD_S, TINY_LLAMA, _save_random_llama

LONG_LLAMA = {**TINY_LLAMA, "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncLLMEngine]:
    """The tiny Llama with an 8k context, 512 tokens a step."""
    path = _save_random_llama(tmp_path_factory, "long_llama", LONG_LLAMA)
    args = EngineArgs(str(path), device="cpu", max_num_batched_tokens=512)
    engine = AsyncLLMEngine.from_engine_args(args)
    yield engine
    engine.shutdown()


class _HeldEngine:
    """`engine.generate` that waits for `release` before a stream starts, counting the
    streams open at once."""

    def __init__(self, engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.generate = engine.generate
        self.release = asyncio.Event()
        self.open = self.most_open = 0
        monkeypatch.setattr(engine, "generate", self.held)

    async def held(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.release.wait()
            async for output in self.generate(*args, **kwargs):
                yield output
        finally:
            self.open -= 1


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


async def _until(check: Any) -> None:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a hang")


def test_a_request_past_the_queue_bound_gets_503_with_retry_after(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> None:
        held = _HeldEngine(engine, monkeypatch)
        app, _ = build_app(engine, "tiny", FrontendArgs(max_queued_requests=1), warm=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 2}
            first = asyncio.create_task(client.post("/v1/completions", json=body))

            async def queued() -> bool:
                metrics = (await client.get("/metrics")).text
                return _metric(metrics, "attnserve:num_requests_queued") == 1

            await _until(queued)
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            assert "--max-queued-requests 1" in refused.json()["error"]["message"]
            metrics = (await client.get("/metrics")).text
            name = 'attnserve:request_rejected_total{reason="queue_full"}'
            assert _metric(metrics, name) == 1
            held.release.set()
            assert (await first).status_code == 200
            metrics = (await client.get("/metrics")).text
            assert _metric(metrics, "attnserve:num_requests_queued") == 0

    asyncio.run(run())


def test_one_requests_prompts_share_its_prompt_token_budget(
    engine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts of 40 tokens under a budget of 79: one in the engine at a time."""

    async def run() -> httpx.Response:
        held = _HeldEngine(engine, monkeypatch)
        held.release.set()
        options = FrontendArgs(max_request_prompt_tokens_in_flight=79)
        app, _ = build_app(engine, "tiny", options, warm=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            prompts = [[i + 1] * 40 for i in range(3)]
            body = {"prompt": prompts, "max_tokens": 3, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body, timeout=HANG_GUARD_S)
        assert held.most_open == 1
        return response

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert response.json()["usage"]["completion_tokens"] == 9


def test_a_short_request_starts_within_two_steps_behind_96k_prompt_tokens(
    engine: AsyncLLMEngine,
) -> None:
    long_params = SamplingParams(max_tokens=1, ignore_eos=True)
    short_params = SamplingParams(max_tokens=2, ignore_eos=True)

    async def first_output(prompt: list[int], params: SamplingParams, rid: str) -> RequestOutput:
        async with aclosing(engine.generate(prompt, params, rid)) as stream:  # type: ignore[type-var]
            async for output in stream:
                return output
        raise AssertionError(f"{rid} gave no output")

    async def run() -> RequestOutput:
        longs = [
            asyncio.create_task(first_output([1 + i % 300] * 6000, long_params, f"long-{i}"))
            for i in range(16)
        ]
        await asyncio.wait(longs, return_when=asyncio.FIRST_COMPLETED)
        short = await asyncio.wait_for(first_output([7, 8, 9], short_params, "short"), 60)
        await asyncio.gather(*longs)
        return short

    short = asyncio.run(run())
    assert short.queued_steps <= 2
