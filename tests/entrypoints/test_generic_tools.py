"""Tools on a model whose chat template shows no tool-call format (the embedded default model),
with no server flag: the server's own format (`generic_tools`).

Offline: the grammar takes text or well-formed calls only, the reader gives the same calls
whole and streamed in every split, earlier calls and tools' answers are written into the
messages. Against the real server (the shared default-model one, started with no tool flags),
through the openai SDK: an agent loop (a forced call, its answer sent back, "auto" well formed
whatever the model chooses), streamed deltas that rebuild the whole reply's call, and one turn
each through LangChain's `ChatOpenAI` and LiteLLM where they are installed. No test depends on
what the model chooses: a call is forced by `tool_choice` where one is needed."""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
import openai
import pytest
from xgrammar.testing import _is_grammar_accept_string

from attnserve.entrypoints.openai.generic_tools import (
    GenericCallStream,
    generic_messages,
    history_messages,
)
from attnserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from attnserve.entrypoints.openai.tool_choice import tool_plan
from attnserve.entrypoints.openai.tool_parsers import HermesStream
from attnserve.output_constraints import build_grammar
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import API_KEY, ServerProcess
from tests.entrypoints.test_openai_structured import WEATHER
from tests.entrypoints.test_tool_parsers import every_split

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = WEATHER["function"]["parameters"]
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "$defs": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
}
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 60}
TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa\\"r}is", "unit": "C"}}'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
)


def _plan_grammar(choice: Any = None, parallel: bool = True) -> Any:
    request = ChatCompletionRequest(
        messages=QUESTION, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel
    )
    plan = tool_plan(request, auto_parser=None)
    assert plan.constraint is not None and plan.template_tools is None
    return build_grammar(plan.constraint)


@pytest.mark.parametrize(
    ("text", "auto", "required", "single"),
    [
        ("", True, False, False),
        ("It is sunny.", True, False, False),
        (" <b>bold</b>", True, False, False),
        ("<tool", True, False, False),
        (TWO_CALLS.split("\n")[0].replace('\\"r}', "r"), True, True, True),
        (TWO_CALLS.replace('\\"r}', "r"), True, True, False),
        (" " + TWO_CALLS.split("\n")[0], False, False, False),  # no text before a call
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "EST"}}</tool_call>', *[False] * 3),
        ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', False, False, False),
        ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', False, False, False),
    ],
)
def test_the_grammar_takes_text_or_well_formed_calls(
    text: str, auto: bool, required: bool, single: bool
) -> None:
    assert _is_grammar_accept_string(_plan_grammar(), text) == auto
    assert _is_grammar_accept_string(_plan_grammar("required"), text) == required
    assert _is_grammar_accept_string(_plan_grammar("auto", parallel=False), text) == (
        single or (auto and not required)
    )


def test_the_reader_streams_the_same_calls_in_every_split() -> None:
    content, calls = every_split(GenericCallStream, TWO_CALLS)
    assert content == ""
    assert calls == [
        ("get_weather", {"city": 'Pa"r}is', "unit": "C"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert every_split(lambda: GenericCallStream(False), TWO_CALLS)[1] == calls[:1]
    text = "Sunny, <tool_call> is how I would call."
    assert every_split(GenericCallStream, text) == (text, [])
    assert every_split(HermesStream, TWO_CALLS)[1] == calls  # Hermes clients read it too


def test_calls_and_answers_are_written_into_the_messages() -> None:
    call = {"id": "c1", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    messages = [
        ChatMessage(role="system", content="Be brief."),
        *[ChatMessage(**m) for m in QUESTION],
        ChatMessage(role="assistant", content="Checking.", tool_calls=[call, {**call, "id": "c2"}]),
        ChatMessage(role="tool", tool_call_id="c1", content="12:00"),
        ChatMessage(role="tool", tool_call_id="c2", content="13:00"),
    ]
    written = [(m.role, m.text()) for m in generic_messages(messages, "BLOCK")]
    line = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    answer = '<tool_response>{"name": "get_time", "content": "%s"}</tool_response>'
    assert written == [
        ("system", "Be brief.\n\nBLOCK"),
        ("user", QUESTION[0]["content"]),
        ("assistant", f"Checking.\n{line}\n{line}"),
        ("user", f"{answer % '12:00'}\n{answer % '13:00'}"),
    ]
    assert [m.role for m in history_messages(messages[1:])] == ["user", "assistant", "user"]


def _valid(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for call in calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        found.append((call.function.name, arguments))
    return found


def _well_formed(choice: Any) -> None:
    """A reply is text, or calls of the tools (with no content) that finished as calls."""
    if choice.message.tool_calls:
        assert _valid(choice.message.tool_calls) and choice.message.content is None
        assert choice.finish_reason in ("tool_calls", "length")
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_an_agent_loop_with_no_server_flag(client: openai.OpenAI) -> None:
    tools: Any = [WEATHER, TIME]
    auto = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=tools, n=2, seed=5, temperature=1, max_tokens=30
    )
    for choice in auto.choices:  # "auto": text or calls, whichever the model picks
        _well_formed(choice)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    forced = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=tools, tool_choice=named, **GREEDY
    )
    choice = forced.choices[0]
    ((name, _),) = _valid(choice.message.tool_calls)
    assert name == "get_weather" and choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]  # type: ignore[index]
    answered: Any = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=answered, tools=tools, **GREEDY)
    _well_formed(reply.choices[0])
    assert reply.usage is not None and forced.usage is not None
    assert reply.usage.prompt_tokens > forced.usage.prompt_tokens + 20  # the call and its answer
    final = client.chat.completions.create(
        model=MODEL, messages=answered, tools=tools, tool_choice="none", **GREEDY
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_deltas_rebuild_the_whole_reply(client: openai.OpenAI, parallel: bool) -> None:
    kwargs: Any = {"tools": [WEATHER, TIME], "tool_choice": "required", **GREEDY}
    kwargs["parallel_tool_calls"] = parallel
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs).choices[0]
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=QUESTION, stream=True, **kwargs
    ):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id and name, then arguments
                assert delta.function and delta.function.name and delta.index == len(calls)
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    expected = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]
    assert list(calls.values()) == expected and finish == whole.finish_reason
    assert len(expected) == 1 or parallel


def test_langchain_chat_openai_binds_tools(default_model_server: ServerProcess) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=default_model_server.url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=60,
        timeout=HANG_GUARD_S,
    )
    forced = model.bind_tools([WEATHER], tool_choice="get_weather").invoke(QUESTION[0]["content"])
    (call,) = forced.tool_calls
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    auto = model.bind_tools([WEATHER]).invoke(QUESTION[0]["content"])  # "auto"
    for call in auto.tool_calls:
        jsonschema.validate(call["args"], WEATHER_PARAMETERS)
    assert auto.tool_calls or isinstance(auto.content, str)


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models
def test_litellm_completion_with_tools(default_model_server: ServerProcess) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=default_model_server.url + "/v1",
        api_key=API_KEY,
        messages=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        timeout=HANG_GUARD_S,
        **GREEDY,
    )
    ((name, _),) = _valid(reply.choices[0].message.tool_calls)
    assert name == "get_weather"
