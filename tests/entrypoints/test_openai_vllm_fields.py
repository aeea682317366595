"""vLLM's request extras, endpoints and stream shape against a real server (the tiny chat model's
shared one, default flags: fcfs, --max-logprobs 20) through the `openai` client's `extra_body`:
`prompt_logprobs`, `truncate_prompt_tokens`, `priority`, `request_id`,
`return_tokens_as_token_ids`, `spaces_between_special_tokens`, the --max-logprobs cap, `/version`,
`/ping`, the null `logprobs` / `finish_reason` of streamed choices and the 404 log line. (The
priority policy's order is tested on the scheduler and engine: tests/engine.)"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

import attnserve
from attnserve.cli import build_parser
from attnserve.engine.arg_utils import EngineArgs
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import TINY_MAX_MODEL_LEN, TINY_MODEL, ServerProcess

PROMPT = "Once upon a time"
TIME = 655  # " time": what the tiny model repeats after PROMPT (greedy)
PROMPT_IDS = [9, 8, 7, 6, 5, 4, 3, 2, 11, 12]
CHAT = [{"role": "user", "content": PROMPT}]
GREEDY: dict[str, Any] = {"model": TINY_MODEL, "temperature": 0, "max_tokens": 4}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_server: ServerProcess) -> ServerProcess:
    return tiny_chat_server


def _refused(call: Any, param: str) -> str:
    """The message of the 400 `call()` gets, which names `param`."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    return str(body["message"])


def test_prompt_logprobs_come_per_choice_as_vllm_returns_them(client: openai.OpenAI) -> None:
    extra = {**NO_EOS, "prompt_logprobs": 2}
    out = client.completions.create(prompt=PROMPT_IDS, n=2, extra_body=extra, **GREEDY)
    for choice in out.choices:
        entries = (choice.model_extra or {})["prompt_logprobs"]
        assert len(entries) == len(PROMPT_IDS) == out.usage.prompt_tokens
        assert entries[0] is None
        for token_id, entry in zip(PROMPT_IDS[1:], entries[1:], strict=True):
            assert str(token_id) in entry and 2 <= len(entry) <= 3  # the top 2 and the prompt's
            assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
            assert entry[str(token_id)]["logprob"] <= 0
            ranks = {e["rank"] for e in entry.values()} - {None}  # (None: outside the top 2)
            assert ranks == {1, 2}
    plain = client.completions.create(prompt=PROMPT_IDS, extra_body=NO_EOS, **GREEDY)
    assert (plain.choices[0].model_extra or {}).get("prompt_logprobs") is None


def test_chat_prompt_logprobs_come_on_the_response(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(messages=CHAT, extra_body={"prompt_logprobs": 0}, **GREEDY)  # type: ignore[arg-type]
    entries = (out.model_extra or {})["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:])  # the prompt's own token


def test_prompt_logprobs_are_not_streamed(client: openai.OpenAI) -> None:
    def call() -> Any:
        return client.completions.create(
            prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}, **GREEDY
        )

    assert "stream" in _refused(call, "prompt_logprobs")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    cut = client.completions.create(
        prompt=PROMPT_IDS, extra_body={**NO_EOS, "truncate_prompt_tokens": 4}, **GREEDY
    )
    tail = client.completions.create(prompt=PROMPT_IDS[-4:], extra_body=NO_EOS, **GREEDY)
    assert cut.usage.prompt_tokens == 4
    assert cut.choices[0].text == tail.choices[0].text
    long_text = "word " * TINY_MAX_MODEL_LEN  # past the context whole
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=long_text, **GREEDY)
    kept = client.completions.create(
        prompt=long_text, extra_body={"truncate_prompt_tokens": 8}, **GREEDY
    )
    assert kept.usage.prompt_tokens == 8
    chat = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        extra_body={"truncate_prompt_tokens": 5},
        **GREEDY,
    )
    assert chat.usage.prompt_tokens == 5


@pytest.mark.parametrize("k", [0, TINY_MAX_MODEL_LEN + 1])
def test_a_truncation_outside_the_context_is_refused(client: openai.OpenAI, k: int) -> None:
    def call() -> Any:
        extra = {"truncate_prompt_tokens": k}
        return client.completions.create(prompt=PROMPT, extra_body=extra, **GREEDY)

    assert f"1..{TINY_MAX_MODEL_LEN}" in _refused(call, "truncate_prompt_tokens")


def test_priority_needs_the_priority_policy(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt=PROMPT, extra_body={"priority": 0}, **GREEDY)
    assert out.choices[0].finish_reason is not None

    def call() -> Any:
        return client.completions.create(prompt=PROMPT, extra_body={"priority": 1}, **GREEDY)

    assert "--scheduling-policy priority" in _refused(call, "priority")


def test_request_id_names_the_response(client: openai.OpenAI) -> None:
    extra = {"request_id": "trace-42"}
    completion = client.completions.create(prompt=PROMPT, extra_body=extra, **GREEDY)
    chat = client.chat.completions.create(messages=CHAT, extra_body=extra, **GREEDY)  # type: ignore[arg-type]
    assert completion.id == "cmpl-trace-42" and chat.id == "chatcmpl-trace-42"


def test_a_request_id_in_flight_is_refused_again(client: openai.OpenAI) -> None:
    """A stream of many long completions holds the id while its first chunk is read."""
    extra = {**NO_EOS, "request_id": "busy"}
    busy = client.completions.create(
        prompt=[PROMPT_IDS] * 64, max_tokens=100, stream=True, extra_body=extra, model=TINY_MODEL
    )
    try:
        next(iter(busy))

        def call() -> Any:
            return client.completions.create(prompt=PROMPT, extra_body=extra, **GREEDY)

        with pytest.raises(openai.BadRequestError, match="already in use"):
            call()
    finally:
        busy.close()


def test_tokens_as_token_ids(client: openai.OpenAI) -> None:
    extra = {**NO_EOS, "return_tokens_as_token_ids": True}
    out = client.completions.create(prompt=PROMPT, logprobs=2, extra_body=extra, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == [f"token_id:{TIME}"] * 4
    assert all(re.fullmatch(r"token_id:\d+", t) for top in logprobs.top_logprobs or [] for t in top)
    chat = client.chat.completions.create(
        messages=CHAT,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(re.fullmatch(r"token_id:\d+", entry.token) for entry in content)
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


def test_spaces_between_special_tokens_is_served(client: openai.OpenAI) -> None:
    """Accepted either way; this fast tokenizer has no such option (as in vLLM, where only slow
    tokenizers heed it: tests/engine/test_detokenizer.py checks it reaches their decodes)."""
    texts = {
        client.completions.create(
            prompt=PROMPT, extra_body={**NO_EOS, "spaces_between_special_tokens": spaces}, **GREEDY
        )
        .choices[0]
        .text
        for spaces in (True, False)
    }
    assert len(texts) == 1


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [("completions", "logprobs"), ("chat", "top_logprobs"), ("completions", "prompt_logprobs")],
)
def test_more_logprobs_than_max_logprobs_are_refused(
    client: openai.OpenAI, endpoint: str, field: str
) -> None:
    def call() -> Any:
        if endpoint == "chat":
            return client.chat.completions.create(
                messages=CHAT,  # type: ignore[arg-type]
                logprobs=True,
                top_logprobs=21,
                **GREEDY,
            )
        return client.completions.create(prompt=PROMPT, extra_body={field: 21}, **GREEDY)

    assert "greater than max allowed: 20" in _refused(call, field)
    out = client.completions.create(prompt=PROMPT, logprobs=20, **GREEDY)
    assert out.choices[0].logprobs is not None


def test_version_and_ping(server: ServerProcess) -> None:
    version = httpx.get(server.url + "/version", timeout=HANG_GUARD_S)
    assert version.json() == {"version": attnserve.__version__}
    for method in ("GET", "POST"):
        ping = httpx.request(method, server.url + "/ping", timeout=HANG_GUARD_S)
        assert ping.status_code == 200 and ping.json() == {"status": "ok"}


def _stream_chunks(server: ServerProcess, path: str, body: dict[str, Any]) -> list[str]:
    """The raw JSON text of each chunk of a streamed call."""
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, timeout=HANG_GUARD_S
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [line[len("data: ") :] for line in lines if line != "data: [DONE]"]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})],
)
def test_streamed_choices_carry_null_logprobs_and_finish_reason(
    server: ServerProcess, path: str, body: dict[str, Any]
) -> None:
    chunks = _stream_chunks(server, path, {**GREEDY, **body, **NO_EOS})
    choices = [choice for chunk in chunks for choice in json.loads(chunk)["choices"]]
    # (how many tokens a chunk carries depends on the machine's pace; chat's first chunk, the
    # role's, always comes alone)
    assert len(choices) >= (2 if "messages" in body else 1)
    for choice in choices:  # the keys are there even where null
        assert "finish_reason" in choice and choice["logprobs"] is None
    assert all(choice["finish_reason"] is None for choice in choices[:-1])
    assert choices[-1]["finish_reason"] == "length"
    if len(chunks) > 1:
        assert '"finish_reason":null' in chunks[0] and '"logprobs":null' in chunks[0]


def test_the_404_log_line_names_the_path(server: ServerProcess) -> None:
    missing = httpx.get(server.url + "/no/such/route", timeout=HANG_GUARD_S)
    assert missing.status_code == 404
    deadline = time.monotonic() + HANG_GUARD_S
    while "404 Not Found (GET /no/such/route)" not in server.log_text():
        assert time.monotonic() < deadline, "no 404 log line naming the path: a hang"
        time.sleep(0.05)


def test_the_vllm_flags_parse() -> None:
    """`attnserve serve`'s vLLM flags: the engine's (--scheduling-policy, --max-logprobs) reach
    `EngineArgs`; --disable-log-requests and --enable-auto-tool-choice are accepted."""
    flags = ["--scheduling-policy", "priority", "--max-logprobs", "5"]
    flags += ["--disable-log-requests", "--enable-auto-tool-choice"]
    args = build_parser().parse_args(["serve", *flags])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.scheduling_policy, engine_args.max_logprobs) == ("priority", 5)
    assert args.disable_log_requests and args.enable_auto_tool_choice
