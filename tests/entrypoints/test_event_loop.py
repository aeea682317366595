"""An event loop that never blocks, against a real `attnserve serve` (the default model's shared
server: a real tokenizer, the default 4 MiB body limit): `/health` keeps answering while the
largest prompts the body limit allows are tokenized (`/tokenize`), refused for their length
(`/v1/completions`) and rendered through the chat template (20,000 messages); and a large body
(decoded and validated off the loop) is answered as a small one is, errors included."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
BIG_PROMPT = "hello " * 650_000  # 3.9 MB of JSON: as large as the 4 MiB body limit allows
# Only a hang guard: /health answers within tens of ms here; tokenizing on the loop stalled it
# for 3 to 9 s.
HEALTH_BOUND_S = 1.0
PADDING = "x" * 100_000  # makes a body large enough to be decoded off the loop


def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=HANG_GUARD_S)


def test_health_answers_while_the_largest_prompts_are_prepared(server: ServerProcess) -> None:
    chat = [{"role": "user", "content": f"message {i}"} for i in range(20_000)]
    requests = [
        ("/tokenize", {"model": MODEL, "prompt": BIG_PROMPT}),
        ("/v1/completions", {"model": MODEL, "prompt": BIG_PROMPT, "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 1}),
    ]
    latencies = []
    with ThreadPoolExecutor(len(requests)) as clients, httpx.Client() as health:
        answers = [clients.submit(_post, server, path, body) for path, body in requests]
        while True:
            started = time.monotonic()
            assert health.get(server.url + "/health", timeout=HANG_GUARD_S).status_code == 200
            latencies.append(time.monotonic() - started)
            if all(answer.done() for answer in answers):
                break
            time.sleep(0.02)
        tokenized, prompt, messages = (answer.result() for answer in answers)
    assert max(latencies) < HEALTH_BOUND_S, latencies
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 650_001
    for response, field in [(prompt, "prompt"), (messages, "messages")]:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (field, "context_length_exceeded")


def test_a_prompt_under_the_bound_is_tokenized_then_refused(server: ServerProcess) -> None:
    """Longer than the context but not so long that its length alone tells: refused once
    tokenized, saying how many tokens it has."""
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hello " * 600})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "the prompt has 601 tokens" in error["message"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")


def _padded(body: dict[str, Any]) -> dict[str, Any]:
    """The body, large (`prompt_cache_key` is accepted without effect)."""
    return {**body, "prompt_cache_key": PADDING}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "n": 99}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "nobody"}]}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user"}], "prompt": 3}),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}),
    ],
    ids=["type", "range", "chat-role", "tokenize-union", "detokenize"],
)
def test_a_large_body_is_refused_as_a_small_one_is(
    server: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    small, large = _post(server, path, body), _post(server, path, _padded(body))
    assert small.status_code == large.status_code == 400
    assert large.json() == small.json()


@pytest.mark.parametrize(
    "raw",
    [b'{"model": nope, "prompt": "', b'{"model": "\xff\xfe", "prompt": "'],
    ids=["not-json", "not-utf8"],
)
def test_a_large_body_that_is_not_json_is_refused_as_a_small_one_is(
    server: ServerProcess, raw: bytes
) -> None:
    def post(content: bytes) -> httpx.Response:
        headers = {**server.headers, "content-type": "application/json"}
        url = server.url + "/v1/completions"
        return httpx.post(url, content=content, headers=headers, timeout=HANG_GUARD_S)

    small, large = post(raw + b'x"}'), post(raw + PADDING.encode() + b'"}')
    assert small.status_code == large.status_code == 400
    assert large.json() == small.json()


def test_a_large_body_is_served(server: ServerProcess) -> None:
    """A chat-style /tokenize (a union of bodies) and a completion, each decoded off the loop."""
    messages = [{"role": "user", "content": "Say hi."}]
    body = {"model": MODEL, "messages": messages}
    small, large = _post(server, "/tokenize", body), _post(server, "/tokenize", _padded(body))
    assert small.status_code == large.status_code == 200
    assert large.json() == small.json()
    body = {"model": MODEL, "prompt": ["Hi", "Hello"], "max_tokens": 2, "temperature": 0}
    small, large = (
        _post(server, "/v1/completions", body),
        _post(server, "/v1/completions", _padded(body)),
    )
    assert small.status_code == large.status_code == 200, large.text
    assert [c["text"] for c in large.json()["choices"]] == [
        c["text"] for c in small.json()["choices"]
    ]
