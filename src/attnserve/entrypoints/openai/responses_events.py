"""`ResponseEvents`: a streamed chat reply (its `chat.completion.chunk` events) as the Responses
API's server-sent events, in the order the openai SDK's `responses.create(stream=True)` reads:
`response.created`, `response.in_progress`; for each output item `response.output_item.added`,
then for a message (or a reasoning item) `response.content_part.added`, its
`response.output_text.delta`s (`response.reasoning_text.delta`s), `response.output_text.done`,
`response.content_part.done`, or for a function call its
`response.function_call_arguments.delta`s and `.done`; `response.output_item.done`; last
`response.completed` with the whole response and its usage (as vLLM, also for a reply cut at
max_output_tokens: its status says "incomplete", and the SDK's
`responses.stream(...).get_final_response()` has it). Every event's data carries its `type` and
`sequence_number`; an engine failure mid-stream is an `error` event, the last one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from attnserve.entrypoints.openai.protocol import UsageInfo
from attnserve.entrypoints.openai.protocol_responses import (
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
)

_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


@dataclass
class _OpenItem:
    """The output item being streamed: where it is in `output`, and its text so far."""

    item: OutputItem
    index: int
    text: str = ""

    @property
    def at(self) -> dict[str, Any]:
        """The item's location, as its events give it."""
        return {"item_id": self.item.id, "output_index": self.index}

    @property
    def in_part(self) -> dict[str, Any]:
        """The location of the item's (one) content part."""
        return {**self.at, "content_index": 0}

    def part(self, text: str) -> OutputText | ReasoningText:
        if isinstance(self.item, OutputMessage):
            return OutputText(text=text)
        return ReasoningText(text=text)


class ResponseEvents:
    """The events of one streamed response (`translate` the chat reply's SSE stream)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self.open: _OpenItem | None = None
        self.finish_reason: str | None = None
        self.usage = UsageInfo()

    async def translate(self, chat_events: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The response's events, from the chat reply's server-sent events."""
        snapshot = self.response.model_dump()
        yield self.event("response.created", response=snapshot) + self.event(
            "response.in_progress", response=snapshot
        )
        try:
            async for block in chat_events:
                events, failed = self._block(str(block))
                yield "".join(events)
                if failed:
                    return
        finally:
            if isinstance(chat_events, AsyncGenerator):
                await chat_events.aclose()  # the client went away: the engine request ends too
        yield "".join(self._finish())

    def event(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _block(self, block: str) -> tuple[list[str], bool]:
        """The events of a block of chat events; whether it ended with an error."""
        events: list[str] = []
        for line in block.splitlines():
            data = line.removeprefix("data: ")
            if data == line or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                fields = {k: error.get(k) for k in ("code", "message", "param")}
                return [*events, self.event("error", **fields)], True
            events += self._chunk(chunk)
        return events, False

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = UsageInfo(**chunk["usage"])
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                events += self._text(OutputReasoning, delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(OutputMessage, delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _start(self, item: OutputItem) -> tuple[list[str], _OpenItem]:
        """The open item closed, `item` opened."""
        events = self._close("completed")
        self.open = opened = _OpenItem(item, len(self.response.output))
        self.response.output.append(item)
        events.append(self.event("response.output_item.added", **opened.at, item=item.model_dump()))
        if not isinstance(item, OutputFunctionCall):
            part = opened.part("").model_dump()
            events.append(self.event("response.content_part.added", **opened.in_part, part=part))
        return events, opened

    def _text(self, kind: type[OutputMessage | OutputReasoning], text: str) -> list[str]:
        events: list[str] = []
        opened = self.open
        if opened is None or not isinstance(opened.item, kind):
            events, opened = self._start(kind(status="in_progress"))
        opened.text += text
        name = _TEXT_EVENTS[opened.item.type] + ".delta"
        extra: dict[str, Any] = {"logprobs": []} if kind is OutputMessage else {}
        events.append(self.event(name, **opened.in_part, delta=text, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function", {})
        opened = self.open
        if call.get("id"):
            name = function.get("name") or ""
            item = OutputFunctionCall(
                status="in_progress", call_id=call["id"], name=name, arguments=""
            )
            events, opened = self._start(item)
        arguments = function.get("arguments")
        if opened is not None and arguments:
            opened.text += arguments
            name = "response.function_call_arguments.delta"
            events.append(self.event(name, **opened.at, delta=arguments))
        return events

    def _close(self, status: ItemStatus) -> list[str]:
        """The open item's closing events (none open: none)."""
        opened, self.open = self.open, None
        if opened is None:
            return []
        item, text = opened.item, opened.text
        if isinstance(item, OutputFunctionCall):
            item.arguments = text
            name = "response.function_call_arguments.done"
            events = [self.event(name, **opened.at, arguments=text)]
        else:
            part = opened.part(text)
            item.content = [part]  # type: ignore[assignment]
            events = [
                self.event(_TEXT_EVENTS[item.type] + ".done", **opened.in_part, text=text),
                self.event("response.content_part.done", **opened.in_part, part=part.model_dump()),
            ]
        item.status = status
        events.append(self.event("response.output_item.done", **opened.at, item=item.model_dump()))
        return events

    def _finish(self) -> list[str]:
        """The last item closed (an empty message if there was none), then the response."""
        events: list[str] = []
        if not self.response.output:
            events, _ = self._start(OutputMessage(status="in_progress"))
        status = self.response.finish(self.finish_reason, self.usage)
        events += self._close(status)
        events.append(self.event("response.completed", response=self.response.model_dump()))
        return events
