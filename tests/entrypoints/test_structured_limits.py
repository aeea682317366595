"""Structured outputs' limits against a real `attnserve serve`: a spec past the size limit, the
compile timeout (a server of the tiny chat model with a 1 ms timeout) or the nesting bound, and
a tool whose parameters schema the compiler refuses, are each a 400 naming the field; and 50
distinct 400 KB constraints (20,000-string enums, about 100 MB compiled each) raise neither the
server's nor its engine core's memory by more than 500 MB (the default model's shared server)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import TINY_MODEL, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Answer."}]
SLOW_REGEX = r"[\s\S]{0,300000}"  # about a second to compile on one core
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_TOOL = {"type": "function", "function": {"name": "g", "parameters": {"type": "objec"}}}
CHOOSE_G = {"type": "function", "function": {"name": "g"}}
MIB = 1 << 20
TIMEOUT_HINT = "(structured_outputs_config compile_timeout_s)"


@pytest.fixture(scope="module")
def timeout_server(tiny_chat_model_dir: Path) -> Iterator[ServerProcess]:
    """The tiny chat model, its compiles refused after 1 ms."""
    args = [str(tiny_chat_model_dir), "--device", "cpu", "--served-model-name", TINY_MODEL]
    args += ["--max-model-len", "128", "--structured-outputs-config", '{"compile_timeout_s": 1e-3}']
    process = ServerProcess(args)
    yield process
    process.stop()


def post(server: ServerProcess, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "messages": ASK, "max_tokens": 1, **fields}
    url = server.url + "/v1/chat/completions"
    return httpx.post(url, json=body, headers=server.headers, timeout=HANG_GUARD_S)


def refusal(response: httpx.Response) -> tuple[str, str]:
    """The param and message of a 400."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return error["param"], error["message"]


def nested_objects(levels: int) -> dict[str, Any]:
    """A schema of `levels` objects, each the one property of the one around it."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"guided_json": nested_objects(242)}, "guided_json", "more than 128 levels deep"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": nested_objects(242)},
                }
            },
            "response_format.json_schema.schema",
            "response_format.json_schema.schema nests objects and arrays more than 128",
        ),
        ({"guided_regex": "a" * 600_000}, "guided_regex", "600000 bytes, over the server's"),
        (
            {"tools": [TOOL, BAD_TOOL], "tool_choice": "required"},
            "tools[1].function.parameters",
            'invalid tools[1].function.parameters: Unsupported type "objec"',
        ),
        (
            {"tools": [BAD_TOOL, TOOL], "tool_choice": CHOOSE_G},
            "tools[0].function.parameters",
            'invalid tools[0].function.parameters: Unsupported type "objec"',
        ),
    ],
)
def test_a_spec_past_a_limit_or_refused_is_a_400_naming_the_field(
    default_model_server: ServerProcess, fields: dict[str, Any], param: str, message: str
) -> None:
    found = refusal(post(default_model_server, MODEL, **fields))
    assert found[0] == param and message in found[1], found


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": SLOW_REGEX}, "guided_regex"),
        ({"structured_outputs": {"regex": SLOW_REGEX + "a"}}, "structured_outputs.regex"),
    ],
)
def test_a_spec_past_the_compile_timeout_is_a_400_naming_the_field(
    timeout_server: ServerProcess, fields: dict[str, Any], param: str
) -> None:
    found = refusal(post(timeout_server, TINY_MODEL, **fields))
    assert found == (param, f"invalid {param}: not compiled within 0.001 s " + TIMEOUT_HINT)
    assert "Traceback" not in timeout_server.log_text()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def large_enum(tag: int) -> dict[str, Any]:
    """A ~420 KB schema: one of 20,000 strings, none shared with another tag's."""
    values = [f"value-{tag:03d}-{i:05d}-x" for i in range(20_000)]
    return {"type": "object", "properties": {"v": {"type": "string", "enum": values}}}


@pytest.mark.slow
def test_50_distinct_400_kb_constraints_raise_no_process_by_500_mb(
    default_model_server: ServerProcess,
) -> None:
    """One at a time (each compiled by the server, then by its core: seconds each); the
    processes' memory sampled until the last has answered."""
    pids = [default_model_server.proc.pid, *default_model_server.engine_core_pids()]
    base = [rss_bytes(pid) for pid in pids]
    peak = list(base)
    codes: list[int] = []

    def send_all() -> None:
        for tag in range(50):
            codes.append(post(default_model_server, MODEL, guided_json=large_enum(tag)).status_code)

    sender = threading.Thread(target=send_all)
    sender.start()
    while sender.is_alive():
        peak = [max(p, rss_bytes(pid)) for p, pid in zip(peak, pids, strict=True)]
        sender.join(0.1)
    assert codes == [200] * 50
    growth_mb = [(p - b) / MIB for p, b in zip(peak, base, strict=True)]
    assert max(growth_mb) <= 500, f"peak RSS growth (server, core): {growth_mb} MB"
