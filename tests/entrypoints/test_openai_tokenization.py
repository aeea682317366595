"""`POST /tokenize` and `POST /detokenize` against a real `attnserve serve` (the default model's
shared server, CPU, an API key), checked against HF transformers' own tokenizer loaded apart:
`encode`, `apply_chat_template`, `convert_ids_to_tokens` and `decode`; each bad input gets its
OpenAI-style error naming the field; both routes need the key; and, in-process over a model
without a tokenizer, each is refused with 400."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.api_server import build_app
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512  # the shared server's --max-model-len
MULTI_BYTE = "héllo 世界 🙂"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _post(server: ServerProcess, path: str, body: Any, key: bool = True) -> httpx.Response:
    headers = server.headers if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=HANG_GUARD_S)


def _ok(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = _post(server, path, body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """HF's own chat template, tokenized (a BatchEncoding in transformers 5, a list before)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("text", ["The capital of France is", MULTI_BYTE, "a\n\tb  c", ""])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_prompt(
    server: ServerProcess, tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": add_special_tokens}
    answer = _ok(server, "/tokenize", body)
    expected = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert answer == {
        "count": len(expected),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": expected,
        "token_strs": None,
    }


def test_token_strs_are_the_tokenizers_own(server: ServerProcess, tokenizer: Any) -> None:
    answer = _ok(server, "/tokenize", {"prompt": MULTI_BYTE, "return_token_strs": True})
    assert answer["tokens"] == tokenizer.encode(MULTI_BYTE)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert len(answer["token_strs"]) == answer["count"] > len(MULTI_BYTE) // 2  # multi-byte


def test_a_prompt_past_the_context_is_counted_not_refused(
    server: ServerProcess, tokenizer: Any
) -> None:
    text = "one two three " * 200
    answer = _ok(server, "/tokenize", {"prompt": text})
    assert answer["tokens"] == tokenizer.encode(text)
    assert answer["count"] > answer["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("messages", "options"),
    [
        (QUESTION, {}),
        (QUESTION, {"add_generation_prompt": False}),
        (
            [*QUESTION, {"role": "assistant", "content": "The capital is"}],
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MULTI_BYTE}],
            {"return_token_strs": True},
        ),
    ],
)
def test_tokenize_messages_as_the_chat_template_does(
    server: ServerProcess, tokenizer: Any, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    answer = _ok(server, "/tokenize", {"model": MODEL, "messages": messages, **options})
    expected = _template_ids(
        tokenizer,
        messages,
        add_generation_prompt=options.get("add_generation_prompt", True),
        continue_final_message=options.get("continue_final_message", False),
    )
    assert answer["tokens"] == expected
    assert answer["count"] == len(expected) and answer["max_model_len"] == MAX_MODEL_LEN
    strs = tokenizer.convert_ids_to_tokens(expected) if options.get("return_token_strs") else None
    assert answer["token_strs"] == strs


def test_tokenize_messages_with_tools(server: ServerProcess, tokenizer: Any) -> None:
    """Tools are taken and go to the template (this model's template does not show them)."""
    answer = _ok(server, "/tokenize", {"messages": QUESTION, "tools": TOOLS})
    assert answer["tokens"] == _template_ids(
        tokenizer, QUESTION, tools=TOOLS, add_generation_prompt=True
    )


def test_tokenize_counts_what_chat_completions_prompts(server: ServerProcess) -> None:
    """The same messages through /tokenize and /v1/chat/completions: one prompt length."""
    counted = _ok(server, "/tokenize", {"messages": QUESTION})["count"]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    assert _ok(server, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == counted


@pytest.mark.parametrize("text", ["The capital of France is", MULTI_BYTE, "<|im_start|>user\nhi"])
def test_detokenize_is_the_tokenizers_decode(
    server: ServerProcess, tokenizer: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert _ok(server, "/detokenize", {"model": MODEL, "tokens": ids}) == {
        "prompt": tokenizer.decode(ids)
    }


def test_round_trip_of_a_multi_byte_string(server: ServerProcess) -> None:
    tokens = _ok(server, "/tokenize", {"prompt": MULTI_BYTE})["tokens"]
    assert _ok(server, "/detokenize", {"tokens": tokens})["prompt"] == MULTI_BYTE


def test_detokenize_edge_ids_and_no_ids(server: ServerProcess, tokenizer: Any) -> None:
    last = len(tokenizer) - 1
    for ids in ([0], [last], [0, last], []):
        assert _ok(server, "/detokenize", {"tokens": ids})["prompt"] == tokenizer.decode(ids)


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (name, path, body, status, param, code)
    ("unknown model", "/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model",
     "model_not_found"),
    ("unknown model, chat", "/tokenize", {"model": "gpt-9", "messages": QUESTION}, 404, "model",
     "model_not_found"),
    ("unknown model, detokenize", "/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model",
     "model_not_found"),
    ("no prompt nor messages", "/tokenize", {"model": MODEL}, 400, "prompt", None),
    ("not an object", "/tokenize", ["hi"], 400, None, None),
    ("prompt of wrong type", "/tokenize", {"prompt": 3}, 400, "prompt", None),
    ("prompt as token ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt", None),
    ("add_special_tokens not a boolean", "/tokenize", {"prompt": "a", "add_special_tokens": 1},
     400, "add_special_tokens", None),
    ("return_token_strs not a boolean", "/tokenize",
     {"messages": QUESTION, "return_token_strs": "yes"}, 400, "return_token_strs", None),
    ("a bad role", "/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages.0.role", None),
    ("a message without content", "/tokenize", {"messages": [{"role": "user"}]}, 400,
     "messages.0.content", None),
    ("empty tools", "/tokenize", {"messages": QUESTION, "tools": []}, 400, "tools", None),
    ("continue_final_message with the generation prompt", "/tokenize",
     {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message", None),
    ("a request chat_template without --trust-request-chat-template", "/tokenize",
     {"messages": QUESTION, "chat_template": "{{ 1 }}"}, 400, "chat_template", None),
    ("apply_chat_template's own argument as a template variable", "/tokenize",
     {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs.tokenize", None),
    ("prompt beside messages", "/tokenize", {"messages": QUESTION, "prompt": "hi"}, 400,
     "prompt", "unsupported_parameter"),
    ("unknown field, detokenize", "/detokenize", {"tokens": [1], "skip_special_tokens": True},
     400, "skip_special_tokens", "unsupported_parameter"),
    ("token id past the vocabulary", "/detokenize", {"tokens": [1, 49152]}, 400, "tokens.1",
     None),
    ("huge token id", "/detokenize", {"tokens": [2, 3, 10**30]}, 400, "tokens.2", None),
    ("negative token id", "/detokenize", {"tokens": [-1]}, 400, "tokens.0", None),
    ("token id not an integer", "/detokenize", {"tokens": [1, 2.5]}, 400, "tokens.1", None),
    ("token id as a string", "/detokenize", {"tokens": ["7"]}, 400, "tokens.0", None),
    ("no tokens", "/detokenize", {"model": MODEL}, 400, "tokens", None),
    ("text to detokenize", "/detokenize", {"tokens": "hi"}, 400, "tokens", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_input_gets_an_openai_error(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    response = _post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize(
    ("path", "body"), [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]
)
def test_both_routes_need_the_api_key(server: ServerProcess, path: str, body: Any) -> None:
    missing = _post(server, path, body, key=False)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    wrong = httpx.post(
        server.url + path, json=body, headers={"Authorization": "Bearer nope"}, timeout=HANG_GUARD_S
    )
    assert wrong.status_code == 401


def test_openapi_documents_both_routes(server: ServerProcess) -> None:
    paths = httpx.get(server.url + "/openapi.json", timeout=HANG_GUARD_S).json()["paths"]
    for path in ("/tokenize", "/detokenize"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413"}
    body = paths["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    refs = {one["$ref"].rsplit("/", 1)[1] for one in body["oneOf"]}
    assert refs == {"TokenizeCompletionRequest", "TokenizeChatRequest"}


@pytest.fixture(scope="module")
def engine_without_tokenizer(tiny_llama_dir: Path) -> Iterator[AsyncLLMEngine]:
    """A tiny random Llama saved without a tokenizer (as the dummy presets are)."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "hi"}, "prompt"),
        ("/tokenize", {"messages": QUESTION}, "messages"),
        ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ],
)
def test_a_model_without_a_tokenizer_refuses_both(
    engine_without_tokenizer: AsyncLLMEngine, path: str, body: dict[str, Any], param: str
) -> None:
    async def post() -> httpx.Response:
        app = build_app(engine_without_tokenizer, "tiny")[0]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json=body, timeout=HANG_GUARD_S)

    response = asyncio.run(post())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "no tokenizer" in error["message"]
