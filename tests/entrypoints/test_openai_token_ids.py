"""The server app in-process over a model without a tokenizer (as the dummy GPU presets are):
token-id prompts are served, whole and streamed, and the generated ids (read back through
the log-probabilities) are HF transformers' own greedy continuation; text prompts and chat are
refused with 400."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.api_server import build_app
from tests.conftest import hf_greedy

PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))
    yield engine
    engine.shutdown()


def _post(engine: AsyncLLMEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(engine, "tiny")[0])
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=60)

    return asyncio.run(run())


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_token_ids_in_greedy_ids_out(engine: AsyncLLMEngine, tiny_llama_dir: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = _post(engine, "/v1/completions", {**body, "logprobs": 1})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert _ids(choice["logprobs"]["tokens"]) == hf_greedy(tiny_llama_dir, PROMPT, 8)
    assert response.json()["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 8,
        "total_tokens": 13,
    }


def test_streamed_token_ids(engine: AsyncLLMEngine, tiny_llama_dir: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body.update(stream=True, logprobs=0, stream_options={"include_usage": True})
    response = _post(engine, "/v1/completions", body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in response.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert _ids(tokens) == hf_greedy(tiny_llama_dir, PROMPT, 6)
    assert chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "text needs a tokenizer"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_text_without_a_tokenizer_is_refused(
    engine: AsyncLLMEngine, path: str, body: dict[str, Any]
) -> None:
    response = _post(engine, path, body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert engine.stats()["kv_cache_usage"] == 0
