"""Tool calls out of a reply's text, as it streams (the whole reply is one last piece).

Each choice of a chat reply with tools gets a `ToolCallStream`; `feed(new text, final)` returns
the content that is safe to show and the tool-call deltas completed so far (OpenAI's streaming
shape: a call's first delta has its index, id, type and name). Which stream:

- `tool_choice` a named function: the output is the arguments (constrained by their schema),
  streamed as argument deltas of one call (`NamedCallStream`);
- `tool_choice` "required": the output is a JSON array of `{"name", "parameters"}` (constrained),
  each call sent once its object is complete (`RequiredCallsStream`);
- `tool_choice` "auto", through the server's `--tool-call-parser` (vLLM's names): `hermes`, the
  Hermes / Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks amid content;
  `llama3_json`, a reply that is JSON `{"name": ..., "parameters": ...}` objects (separated by
  `;`, after an optional `<|python_tag|>`), anything else being content.

Without `parallel_tool_calls`, calls after the first are dropped.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from attnserve.entrypoints.openai.protocol_structured import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

_DECODER = json.JSONDecoder()


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_parts(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)


def _next_objects(text: str, pos: int, separators: str) -> tuple[list[Any], int]:
    """The complete JSON values from `pos` on, skipping whitespace and `separators` between
    them, and where the first incomplete one starts."""
    values: list[Any] = []
    while True:
        start = pos
        while start < len(text) and (text[start].isspace() or text[start] in separators):
            start += 1
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return values, pos
        values.append(value)
        pos = end


def _held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back while streaming)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """No tools: everything is content."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.parallel = parallel_tool_calls
        self.text = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """What `text`, the reply's next piece, adds: content, and tool-call deltas."""
        self.text += text
        return text, []

    def _call(self, name: str, arguments: str) -> list[DeltaToolCall]:
        """A new call's delta (none past the first without parallel tool calls)."""
        if self.num_calls and not self.parallel:
            return []
        function = DeltaFunctionCall(name=name, arguments=arguments)
        delta = DeltaToolCall(
            index=self.num_calls, id=new_tool_call_id(), type="function", function=function
        )
        self.num_calls += 1
        return [delta]


class NamedCallStream(ToolCallStream):
    def __init__(self, name: str) -> None:
        super().__init__(parallel_tool_calls=False)
        self.name = name

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        if not self.num_calls:
            return "", self._call(self.name, text)
        arguments = DeltaFunctionCall(arguments=text)
        return "", [DeltaToolCall(index=0, function=arguments)] if text else []


class RequiredCallsStream(ToolCallStream):
    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self.pos = 0  # where the next call object (or the array's opening) starts

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        values, self.pos = _next_objects(self.text, self.pos, "[,")
        deltas = []
        for value in values:
            parts = _call_parts(value)
            if parts is not None:
                deltas += self._call(*parts)
        return "", deltas


class HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self.pos = 0  # the text before this is sent, as content or as calls

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        content, deltas = [], []
        while True:
            start = self.text.find(self.OPEN, self.pos)
            if start < 0:
                end = len(self.text) - (0 if final else _held_prefix(self.text, self.OPEN))
                if final or not self._between_calls(self.text[self.pos : end]):
                    content.append(self._content(self.text[self.pos : end]))
                    self.pos = end
                break
            content.append(self._content(self.text[self.pos : start]))
            body_start = start + len(self.OPEN)
            close = self.text.find(self.CLOSE, body_start)
            if close < 0 and not final:
                self.pos = start
                break
            body_end = len(self.text) if close < 0 else close
            parsed = self._parse(self.text[body_start:body_end])
            if parsed is None:
                content.append(self.text[start : body_end + (0 if close < 0 else len(self.CLOSE))])
            else:
                deltas += self._call(*parsed)
            self.pos = len(self.text) if close < 0 else close + len(self.CLOSE)
        return "".join(content), deltas

    def _between_calls(self, text: str) -> bool:
        """Only whitespace after a call: held until it is known whether content follows."""
        return bool(self.num_calls) and not text.strip()

    def _content(self, text: str) -> str:
        """Content, except whitespace between (or after) calls."""
        return "" if self._between_calls(text) else text

    @staticmethod
    def _parse(body: str) -> tuple[str, str] | None:
        try:
            return _call_parts(json.loads(body))
        except json.JSONDecodeError:
            return None


class Llama3JsonStream(ToolCallStream):
    """A reply that starts as JSON is held back until it is whole: calls if every value in it is
    one, else content; any other reply streams as content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self.mode: str | None = None  # "json" or "content", once the reply's start tells

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        if self.mode == "content":
            return text, []
        self.mode = self.mode or self._decide(final)
        if self.mode == "content":
            return self.text, []
        if not final:
            return "", []
        body = self.text.lstrip()
        body = body.removeprefix(self.PYTHON_TAG)
        values, end = _next_objects(body, 0, ";")
        calls = [_call_parts(value) for value in values]
        if not values or body[end:].strip() or None in calls:
            return self.text, []
        return "", [delta for parts in calls if parts is not None for delta in self._call(*parts)]

    def _decide(self, final: bool) -> str | None:
        start = self.text.lstrip()
        if start.startswith(("{", self.PYTHON_TAG)):
            return "json"
        if not final and (not start or self.PYTHON_TAG.startswith(start)):
            return None  # too early to tell
        return "content"


TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
}


def merged_calls(deltas: list[DeltaToolCall]) -> list[ToolCall]:
    """The whole calls the deltas stream (arguments joined per index)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        arguments = delta.function.arguments or ""
        if call is None:
            function = FunctionCall(name=delta.function.name or "", arguments=arguments)
            calls[delta.index] = ToolCall(id=delta.id or new_tool_call_id(), function=function)
        else:
            call.function.arguments += arguments
    return [calls[index] for index in sorted(calls)]


# what a chat template writes around a tool call -> the parser that reads it back
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))


def parser_for_chat_template(template: str | None) -> str | None:
    """The tool-call parser a chat template's own tool-call format calls for (hermes for the
    Hermes / Qwen `<tool_call>` blocks, llama3_json for Llama 3.x), None when it shows none."""
    for mark, parser in _TEMPLATE_MARKS:
        if template and mark in template:
            return parser
    return None
