"""`POST /v1/responses` through the official `openai` client's `responses.create` against a real
`attnserve serve` (the default model's shared server: CPU, hermes tool calling).

A response is the chat reply it stands for (same text and token counts, greedy); its streamed
events come in the order the SDK reads, numbered, and add up to the whole; a reply cut at
max_output_tokens is "incomplete"; a function tool's call is a `function_call` item whose output
goes back as input; fields the server cannot serve are 400s naming them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from attnserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatResponseMessage,
    UsageInfo,
)
from attnserve.entrypoints.openai.protocol_responses import ResponseObject
from attnserve.entrypoints.openai.responses_events import ResponseEvents
from attnserve.entrypoints.openai.serving_responses import finished
from tests.entrypoints.openai_server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a terse assistant."
QUESTION = "Name a primary colour."
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 24}


def test_a_response_is_the_chat_reply_it_stands_for(client: openai.OpenAI) -> None:
    response = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_completion_tokens=24,  # type: ignore[arg-type]
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    # the same conversation as items (a developer message, input_text parts)
    items: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    ]
    assert client.responses.create(input=items, **GREEDY).output_text == response.output_text


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(input=QUESTION, **GREEDY)
    events = list(client.responses.create(input=QUESTION, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[:4] == [*head, "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done"]
    assert kinds[-4:] == [*closing, "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage == whole.usage


def test_a_reply_cut_at_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    cut: dict[str, Any] = {**GREEDY, "max_output_tokens": 2}
    response = client.responses.create(input="Tell me a long story.", **cut)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 2
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    with client.responses.stream(input="Tell me a long story.", **cut) as stream:
        streamed = stream.get_final_response()  # (as vLLM: response.completed, incomplete)
    assert streamed.status == "incomplete" and streamed.output_text == response.output_text


def test_a_function_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "name": "get_weather"}
    question = "What is the weather in Paris?"
    kwargs: dict[str, Any] = {"tools": [WEATHER], "tool_choice": named, **GREEDY}
    kwargs["max_output_tokens"] = 40
    response = client.responses.create(input=question, **kwargs)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert (
        call.call_id.startswith("call_")
        and json.loads(call.arguments)["city"]
        in WEATHER["parameters"]["properties"]["city"]["enum"]
    )
    events = list(client.responses.create(input=question, stream=True, **kwargs))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    assert events[-1].response.output[0].arguments == call.arguments  # type: ignore[union-attr]
    answered: Any = [
        {"role": "user", "content": question},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # (dropped)
        *response.output,  # as an agent loop sends it back
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    follow_up = client.responses.create(input=answered, tools=[WEATHER], **GREEDY)
    assert follow_up.status in ("completed", "incomplete") and follow_up.output


def test_a_json_schema_text_format_constrains_the_output(client: openai.OpenAI) -> None:
    city = WEATHER["parameters"]
    text: Any = {"format": {"type": "json_schema", "name": "city", "schema": city}}
    response = client.responses.create(input="Pick a city.", text=text, **GREEDY)
    assert json.loads(response.output_text)["city"] in city["properties"]["city"]["enum"]
    assert response.text is not None and response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ],
)
def test_unsupported_fields_are_refused_by_name(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, extra_body=extra)
    body: Any = caught.value.body
    assert body["param"] == param and param.split(".")[0] in body["message"]


def _chat_sse(*chunks: dict[str, Any]) -> AsyncIterator[str]:
    """A chat reply's server-sent events, as the chat endpoint writes them."""

    async def events() -> AsyncIterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return events()


def _translated(*chunks: dict[str, Any]) -> list[dict[str, Any]]:
    async def collect() -> list[str]:
        events = ResponseEvents(ResponseObject(model=MODEL)).translate(_chat_sse(*chunks))
        return [block async for block in events]

    blocks = "".join(asyncio.run(collect()))
    return [
        json.loads(line[len("data: ") :]) for line in blocks.splitlines() if line[:5] == "data:"
    ]


def _delta(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta}]}


def test_thinking_text_and_calls_stream_as_items_in_order() -> None:
    """A reply's thinking (--reasoning-parser), its text and calls whose arguments come in
    pieces: one item each, in order, each closed before the next opens."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    events = _translated(
        _delta(role="assistant", content=""),
        _delta(reasoning_content="hm"),
        _delta(content="Hi"),
        _delta(tool_calls=[{**call, "function": {"name": "f", "arguments": '{"a"'}}]),
        _delta(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
    )
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call"]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert done[2]["arguments"] == '{"a": 1}' and done[2]["call_id"] == "call_1"
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output"] == done
    assert final["response"]["usage"]["output_tokens"] == 7
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_whole_reply_with_thinking_cut_short() -> None:
    """A reply split by --reasoning-parser and cut at max_output_tokens: a reasoning item, then
    the message, both incomplete; the usage under the Responses API's names."""
    message = ChatResponseMessage(content="Hi", reasoning_content="hm")
    choice = ChatChoice(index=0, message=message, finish_reason="length")
    counts = UsageInfo(prompt_tokens=5, completion_tokens=7, total_tokens=12)
    chat = ChatCompletionResponse(id="chatcmpl-1", model=MODEL, choices=[choice], usage=counts)
    response = finished(ResponseObject(model=MODEL), chat).model_dump()
    assert [(item["type"], item["status"]) for item in response["output"]] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]
    assert response["output"][1]["content"][0]["text"] == "Hi"
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["input_tokens"] == 5 and response["usage"]["total_tokens"] == 12


def test_an_engine_failure_mid_stream_is_the_last_event() -> None:
    failure = {"error": {"message": "the engine has failed", "type": "x", "param": None}}
    events = _translated(_delta(content="Hi"), failure)
    assert events[-1]["type"] == "error" and events[-1]["message"] == "the engine has failed"
    assert "response.completed" not in [e["type"] for e in events]


def _finished(server: ServerProcess) -> float:
    """Requests finished so far (any reason): an aborted one is not among them."""
    metrics = server.wait_idle()
    return sum(v for k, v in metrics.items() if k.startswith("attnserve:request_success_total"))


def test_a_dropped_stream_aborts_its_request(
    client: openai.OpenAI, default_model_server: ServerProcess
) -> None:
    before = _finished(default_model_server)
    essay = "Write a very long essay about the history of Rome."  # greedy: runs to 400 tokens
    long: dict[str, Any] = {**GREEDY, "max_output_tokens": 400}
    with client.responses.create(input=essay, stream=True, **long) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break  # the connection closes here, mid-generation
    assert _finished(default_model_server) == before  # aborted, not run on to its end
