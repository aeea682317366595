"""Structured outputs and tool calling through the official `openai` client against a real
`attnserve serve` (default model, CPU, no tool flags: its tools in the server's own format;
shared with test_openai_server.py).

Outputs are checked by `jsonschema` against the schema asked for (n=2, streamed; compact unless
free whitespace is asked for), tool calls by their function's parameters schema; a spec the
compiler refuses is a 400 carrying its message; after all of it, no KV block is held."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from attnserve.entrypoints.openai.protocol_structured import DeltaFunctionCall, DeltaToolCall
from attnserve.entrypoints.openai.tool_parsers import merged_calls
from tests.engine.compact_json import loose_whitespace
from tests.entrypoints.openai_server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
}
ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
            "required": ["zone"],
        },
    },
}
PARAMETERS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED: dict[str, Any] = {"temperature": 0.5, "seed": 11, "max_tokens": 120}


def city_format(strict: bool = True) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": CITY, "strict": strict},
    }


def test_json_schema_replies_validate_for_n_2(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, n=2, response_format=city_format(), **SAMPLED
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)


def test_json_schema_streamed_validates_and_equals_the_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=city_format(False), **SAMPLED
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=city_format(False), stream=True, **SAMPLED
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(text), CITY)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_is_compact_unless_free_whitespace_is_asked_for(client: openai.OpenAI) -> None:
    """`response_format`'s JSON has no newline, no whitespace outside strings but the single
    spaces of `", "` and `": "`; `structured_outputs.disable_any_whitespace: false` still
    serves JSON (free whitespace allowed)."""
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 120}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=city_format(), **greedy
    )
    text = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)
    assert loose_whitespace(text) == [] and "\n" not in text
    free = {"structured_outputs": {"json": CITY, "disable_any_whitespace": False}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=free, **greedy)
    text = reply.choices[0].message.content or ""
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(text), CITY)
    else:
        assert text.lstrip().startswith("{")


def test_json_object_and_the_completions_endpoint(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, **SAMPLED
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:
        assert (reply.choices[0].message.content or "").startswith("{")
    completion = client.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer:",
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": r" (Yes|No)\."}},
    )
    assert re.fullmatch(r" (Yes|No)\.", completion.choices[0].text)


def test_vllm_structured_outputs_and_the_older_guided_fields(client: openai.OpenAI) -> None:
    choices = ["positive", "negative"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Sentiment of: I love it!"}],
            max_tokens=10,
            temperature=0,
            extra_body=extra,
        )
        assert reply.choices[0].message.content in choices
        assert reply.choices[0].finish_reason == "stop"


def valid_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each call, its arguments validated against its function's schema."""
    found = []
    for call in calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        found.append((call.function.name, arguments))
    return found


def test_named_tool_choice_whole_and_streamed(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: dict[str, Any] = {"tools": [WEATHER, TIME], "tool_choice": named, "temperature": 0}
    reply = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, arguments),) = valid_calls(choice.message.tool_calls)
    assert name == "get_weather"
    stream = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, stream=True, **kwargs
    )
    chunks = [c for c in stream if c.choices]
    deltas = [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            function=DeltaFunctionCall(name=d.function.name, arguments=d.function.arguments),
        )
        for c in chunks
        for d in c.choices[0].delta.tool_calls or []
    ]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather"  # arguments streamed
    assert valid_calls(merged_calls(deltas)) == [(name, arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client: openai.OpenAI, parallel: bool) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Rome and the time in CET?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0,
        max_tokens=150,
    )
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    if parallel:  # this small model repeats its call until max_tokens: the last one is cut
        assert len(calls) >= 1 and choice.finish_reason in ("tool_calls", "length")
        valid_calls(calls[:-1] if choice.finish_reason == "length" else calls)
    else:
        assert len(valid_calls(calls)) == 1 and choice.finish_reason == "tool_calls"


def test_tool_history_and_auto_choice(client: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=16, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "Regex parsing error at position 4"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, 'Rule "nope" is not defined'),
        ({"guided_json": {"type": "objec"}}, 'Unsupported type "objec"'),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format and guided_regex each constrain the output",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice names 'x', which is not in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": city_format()},
            "tool_choice constrains the output already",
        ),
        ({"min_tokens": 3, "guided_regex": "a+"}, "min_tokens cannot be combined"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            'invalid response_format.json_schema.schema: Unsupported type "objec"',
        ),
    ],
)
def test_refusals_are_400s_with_the_reason(
    client: openai.OpenAI, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert message in str(caught.value)


def test_no_block_is_left_held(server: ServerProcess) -> None:
    idle = server.wait_idle()
    assert idle["attnserve:kv_cache_usage_perc"] == 0
    assert idle["attnserve:num_requests_running"] == 0
