"""Bad input against a real server (a tiny random model with the default model's tokenizer;
shared with test_openai_fields.py): each kind of bad request gets an OpenAI-style error object
with the right status, is logged, and the server keeps serving (JSON nested too deeply, token
ids past the vocabulary, a 405 with its Allow header among them); then schemathesis fuzzes the
OpenAPI document: no 5xx."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from attnserve.entrypoints.openai.errors import ApiError, error_response
from attnserve.entrypoints.openai.json_body import MAX_JSON_DEPTH
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import (
    TINY_MAX_BYTES,
    TINY_MAX_MODEL_LEN,
    TINY_MODEL,
    ServerProcess,
)

MAX_MODEL_LEN = TINY_MAX_MODEL_LEN
MAX_BYTES = TINY_MAX_BYTES
FUZZ_EXAMPLES = 50  # per generation mode, over all routes


@pytest.fixture(scope="module")
def server(tiny_chat_server: ServerProcess) -> ServerProcess:
    """The tiny chat model's shared server (tests/entrypoints/conftest.py)."""
    return tiny_chat_server


def _post(server: ServerProcess, path: str, content: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=HANG_GUARD_S)


CHAT = {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}]}


def _nested(levels: int) -> bytes:
    """A completions body whose field "x" nests its arrays so the body is `levels` deep."""
    inner = levels - 1  # the body's own object is one level
    return b'{"prompt": "hi", "x": ' + b"[" * inner + b"]" * inner + b"}"


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body: bytes or JSON-able, status, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("prompt of wrong type", "/v1/completions", {"prompt": 3}, 400, "prompt"),
    ("temperature of wrong type", "/v1/completions", {"prompt": "a", "temperature": "x"}, 400,
     "temperature"),
    ("missing messages", "/v1/chat/completions", {"model": TINY_MODEL}, 400, "messages"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
     "messages.0.content"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("prompt over max_model_len", "/v1/completions",
     {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt"),
    ("max_tokens past the context", "/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 400,
     "max_tokens"),
    ("max_tokens of 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("n of 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("n over the limit", "/v1/chat/completions", {**CHAT, "n": 1000}, 400, "n"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("min_tokens over max_tokens", "/v1/completions",
     {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, None),
    ("body over the size limit", "/v1/completions", {"prompt": "a " * MAX_BYTES}, 413, None),
    ("65 prompts", "/v1/completions", {"prompt": ["a"] * 65}, 400, "prompt"),
    ("JSON nested past the parser's limit", "/v1/completions", _nested(5000), 400, None),
    ("JSON nested one level too deep", "/v1/completions", _nested(MAX_JSON_DEPTH + 1), 400,
     None),
    ("stop_token_ids past int64", "/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]},
     400, "stop_token_ids"),
    ("stop_token_ids past the vocabulary", "/v1/chat/completions",
     {**CHAT, "stop_token_ids": [1, 10**6]}, 400, "stop_token_ids"),
    ("logit_bias key past int64", "/v1/completions",
     {"prompt": "hi", "logit_bias": {str(2**70): 1}}, 400, "logit_bias"),
    ("json_schema without its schema", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
]  # fmt: skip


def test_too_many_prompts_get_one_plain_message(server: ServerProcess) -> None:
    response = _post(server, "/v1/completions", b'{"prompt": [' + b'"a",' * 64 + b'"a"]}')
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and ";" not in message  # one complaint, not four
    assert "at most 64 prompts in one request, got 65" in message


def test_a_body_that_is_not_utf8_is_named_so(server: ServerProcess) -> None:
    response = _post(server, "/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert response.status_code == 400 and "UTF-8" in response.json()["error"]["message"]


def test_json_nesting_is_bounded_and_named(server: ServerProcess) -> None:
    for levels in (MAX_JSON_DEPTH + 1, 5000):
        error = _post(server, "/v1/completions", _nested(levels)).json()["error"]
        assert "nested too deeply" in error["message"] and str(MAX_JSON_DEPTH) in error["message"]
    read = _post(server, "/v1/completions", _nested(MAX_JSON_DEPTH)).json()["error"]
    assert read["param"] == "x" and "unknown field" in read["message"]  # read whole, then judged


def test_expected_503s_are_logged_as_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="attnserve.entrypoints.openai.errors")
    error_response(ApiError(503, "the engine is warming up", code="warming_up"))
    error_response(ApiError(503, "the engine has failed: gone"))
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("INFO", "503 the engine is warming up"),
        ("ERROR", "503 the engine has failed: gone"),
    ]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_gets_an_openai_error(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    logged = len(server.log_text())
    response = _post(server, path, content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert f" {status} " in server.log_text()[logged:]  # logged
    good = _post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_streamed_errors_come_before_the_stream(server: ServerProcess) -> None:
    body = b'{"prompt": "hi", "model": "nope", "stream": true}'
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"


def test_unknown_route_and_wrong_method(server: ServerProcess) -> None:
    unknown = httpx.get(server.url + "/v1/nothing", timeout=HANG_GUARD_S)
    assert unknown.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(server.url + "/v1/completions", timeout=HANG_GUARD_S)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert wrong_method.headers["allow"] == "POST"
    not_get = httpx.post(server.url + "/health", timeout=HANG_GUARD_S)
    assert not_get.status_code == 405 and not_get.headers["allow"] == "GET"


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_server_error(server: ServerProcess, mode: GenerationMode) -> None:
    """Cases drawn from the OpenAPI document, valid or not: no 5xx, and every response (status,
    content type, body) as the document says."""
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")

    @given(case=api.as_strategy(mode))
    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case: Any) -> None:
        case.call_and_validate(checks=CHECKS, timeout=HANG_GUARD_S)

    call()
    assert httpx.get(server.url + "/health", timeout=HANG_GUARD_S).status_code == 200


def test_schema_documents_every_route(server: ServerProcess) -> None:
    paths = httpx.get(server.url + "/openapi.json", timeout=HANG_GUARD_S).json()["paths"]
    assert set(paths) == {
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
    }
    responses = paths["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413"} <= set(responses)
    assert "422" not in responses  # a body off the schema is a 400, as in OpenAI's API
    assert "text/event-stream" in responses["200"]["content"]
