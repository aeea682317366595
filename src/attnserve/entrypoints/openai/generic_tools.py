"""The server's own tool-call format, for models whose chat template shows none it knows (and no
`--tool-call-parser`): the tools go into the prompt, the output is constrained to the format, and
the reply is read back with it. So tools work on every model, the embedded one included.

The prompt (`generic_messages`): a system block (`tools_block`) listing each tool as one JSON line
`{"name", "description", "parameters"}` inside `<tools>...</tools>` and saying how to call; it
ends the first system message, or is one of its own before the conversation. Earlier turns are
written in the same format: an assistant's calls as its `<tool_call>` lines (after its content),
a tool's answers as a user message of `<tool_response>{"name", "content"}</tool_response>` lines
(the consecutive answers to one turn's calls together). Templates without tool support get their
history this way whatever the request's tool choice (`history_messages`).

The reply (`calls_grammar`): either plain text that does not start with `<tool_call>`, or calls
only, one per line (one at most without `parallel_tool_calls`), each exactly
`<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>`, its arguments following the tool's
parameters schema (compact JSON). "auto" allows both; "required" and a named function allow only
calls (of that function). `GenericCallStream` reads it: content, or the calls streamed as OpenAI's
deltas (index, id and name first, then the arguments as they come).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol import ChatMessage
from attnserve.entrypoints.openai.protocol_structured import (
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
)
from attnserve.entrypoints.openai.structured import named_tool_spec, parameters_field
from attnserve.entrypoints.openai.tool_parsers import ToolCallStream
from attnserve.output_constraints import StructuredOutputsParams, build_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_HEAD = '{"name": '  # then the name, ARGUMENTS_KEY, the arguments, CALL_TAIL
ARGUMENTS_KEY = ', "arguments": '
CALL_TAIL = "}" + CLOSE
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*</tool_call>")
# an EBNF text's pieces: strings and character classes (kept), rule names (renamed)
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*')


def call_text(name: str, arguments: Any) -> str:
    """One call in the format (`arguments`: an object, or JSON text)."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}{body}{CLOSE}"


def tools_block(tools: list[ChatCompletionTool], choice: str, parallel: bool) -> str:
    """The system block that lists the tools and says how to call them; `choice`: "auto",
    "required" or the one function's name."""
    lines = [
        json.dumps(
            {
                "name": tool.function.name,
                "description": tool.function.description or "",
                "parameters": tool.function.parameters_schema,
            },
            ensure_ascii=False,
        )
        for tool in tools
    ]
    example = call_text("FUNCTION_NAME", {"ARGUMENT": "VALUE"})
    how = "one line per call" if parallel else "one call at most"
    if choice == "auto":
        rule = f"To call functions, reply with only the calls ({how}), each as:\n{example}\n"
        rule += "Otherwise, answer in plain text."
    elif choice == "required":
        rule = f"Reply with only function calls ({how}), each as:\n{example}"
    else:
        rule = f"Reply with only a call of {choice}, as:\n{example}"
    tool_list = "\n".join(lines)
    return f"# Tools\n\nYou can call these functions:\n<tools>\n{tool_list}\n</tools>\n\n{rule}"


def _response(message: ChatMessage, names: dict[str, str]) -> str:
    """A tool's answer as a `<tool_response>` line, named by the call it answers."""
    name = message.name or names.get(message.tool_call_id or "")
    body: dict[str, Any] = {"name": name} if name else {}
    body["content"] = message.text()
    return f"<tool_response>{json.dumps(body, ensure_ascii=False)}</tool_response>"


def history_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation with its tool calls and answers written in the format, as plain
    assistant and user messages (for templates that have no tool support)."""
    names: dict[str, str] = {}
    out: list[ChatMessage] = []
    answers = False  # whether the last message out is tools' answers
    for message in messages:
        if message.role == "tool":
            line = _response(message, names)
            if answers:
                out[-1] = ChatMessage(role="user", content=f"{out[-1].text()}\n{line}")
            else:
                out.append(ChatMessage(role="user", content=line))
            answers = True
            continue
        answers = False
        if message.role == "assistant" and message.tool_calls:
            calls = []
            for call in message.tool_calls:
                names[call.id] = call.function.name
                calls.append(call_text(call.function.name, call.function.arguments))
            text = "\n".join([message.text(), *calls] if message.text() else calls)
            message = message.model_copy(update={"content": text, "tool_calls": None})
        out.append(message)
    return out


def generic_messages(messages: list[ChatMessage], block: str) -> list[ChatMessage]:
    """The conversation in the format, `block` ending its first system message (or before it)."""
    out = history_messages(messages)
    if out and out[0].role in ("system", "developer"):
        first = out[0]
        out[0] = first.model_copy(update={"content": f"{first.text()}\n\n{block}"})
        return out
    return [ChatMessage(role="system", content=block), *out]


def _literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _renamed(ebnf: str, prefix: str) -> str:
    """An EBNF text with every rule name prefixed (strings and classes untouched)."""

    def rename(match: re.Match[str]) -> str:
        token = match.group(0)
        return token if token[0] in '"[' else prefix + token

    return _EBNF_TOKEN.sub(rename, ebnf)


def _text_rules(name: str) -> list[str]:
    """The rules of a text whose first characters past any whitespace do not begin OPEN (the
    empty text included)."""
    options = ['""', r"[^< \t\n\r] [^]*"]
    for i, char in enumerate(OPEN[1:], start=1):
        head = _literal(OPEN[:i])
        options += [head, f"{head} [^{re.escape(char)}] [^]*"]
    return [f"{name} ::= [ \\t\\n\\r]* {name}_rest", f"{name}_rest ::= " + " | ".join(options)]


def calls_grammar(tools: list[ChatCompletionTool], choice: str, parallel: bool) -> str:
    """The EBNF of a reply in the format: `choice` "auto" (text or calls), "required" (calls)
    or one function's name (its calls). 400 naming the tool whose parameters schema the
    grammar compiler refuses."""
    rules, cases = [], []
    for index, tool in enumerate(tools):
        name = tool.function.name
        if choice not in ("auto", "required") and name != choice:
            continue
        field = parameters_field(index)
        try:
            grammar = build_grammar(named_tool_spec(tools, index))
        except ValueError as error:
            raise ApiError(400, f"invalid {field}: {error}", field) from None
        rules.append(_renamed(str(grammar), f"tool{index}_"))
        head = _literal(json.dumps(name) + ARGUMENTS_KEY)
        cases.append(f"({head} tool{index}_root)")
    call = f"{_literal(OPEN + CALL_HEAD)} ({' | '.join(cases)}) {_literal(CALL_TAIL)}"
    calls = 'tool_reply_call ("\\n" tool_reply_call)*' if parallel else "tool_reply_call"
    root = "tool_reply_calls | tool_reply_text" if choice == "auto" else "tool_reply_calls"
    top = [
        f"root ::= {root}",
        f"tool_reply_calls ::= {calls}",
        f"tool_reply_call ::= {call}",
        *_text_rules("tool_reply_text"),
    ]
    return "\n".join(top + rules) + "\n"


def generic_spec(
    tools: list[ChatCompletionTool], choice: str, parallel: bool
) -> StructuredOutputsParams:
    """The output constraint of a reply in the format (see `calls_grammar`)."""
    return StructuredOutputsParams(grammar=calls_grammar(tools, choice, parallel))


class GenericCallStream(ToolCallStream):
    """A reply in the format: content unless it starts with OPEN; else its calls, each one's
    first delta (index, id, name) as soon as its name is whole, then its arguments as they
    come. What strays from the format (a reply cut short or not constrained) ends the calls:
    the rest is content."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self.mode: str | None = None  # "content" or "calls", once the reply's start tells
        self.pos = 0  # the text before this is read
        self.state = "open"  # in calls: open, head, arguments or tail
        self.index: int | None = None  # the call being read (None: dropped, not parallel)
        self.depth = 0  # the arguments' nesting, while they stream
        self.in_string = self.escaped = False

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += text
        if self.mode is None:
            start = self.text
            if not final and OPEN.startswith(start):
                return "", []
            self.mode = "calls" if start.startswith(OPEN) else "content"
            if self.mode == "content":
                return start, []
        if self.mode == "content":
            return text, []
        deltas: list[DeltaToolCall] = []
        while self.pos < len(self.text) and self.mode == "calls":
            if not self._step(deltas, final):
                break
        if self.mode == "content":  # strayed: the rest is content
            rest, self.pos = self.text[self.pos :], len(self.text)
            return rest, deltas
        return "", deltas

    def _step(self, deltas: list[DeltaToolCall], final: bool) -> bool:
        """Read on from `pos` in the current state; False when more text is needed."""
        rest = self.text[self.pos :]
        if self.state == "arguments":
            deltas += self._arguments(rest)
            return self.state != "arguments"
        if self.state == "open":
            stripped = rest.lstrip()
            if stripped.startswith(OPEN):
                self.pos += len(rest) - len(stripped) + len(OPEN)
                self.state = "head"
                return True
            return self._wait(not stripped or OPEN.startswith(stripped), final)
        pattern = _HEAD if self.state == "head" else _TAIL
        match = pattern.match(rest)
        if match is None:
            return self._wait(True, final)
        self.pos += match.end()
        if self.state == "tail":
            self.state = "open"
            return True
        deltas += self._start(json.loads(match.group(1)))
        return True

    def _wait(self, maybe: bool, final: bool) -> bool:
        """More text is needed where it `maybe` completes what is read; else (or at the end) the
        reply strays from the format (only whitespace after the calls does not)."""
        if not maybe or final:
            if self.text[self.pos :].strip():
                self.mode = "content"
            else:
                self.pos = len(self.text)
        return False

    def _start(self, name: str) -> list[DeltaToolCall]:
        """A call's first delta (none for a call dropped without parallel tool calls)."""
        self.state = "arguments"
        self.depth, self.in_string, self.escaped = 0, False, False
        deltas = self._call(name, "")
        self.index = deltas[0].index if deltas else None
        return deltas

    def _arguments(self, rest: str) -> list[DeltaToolCall]:
        """The arguments in `rest` up to their end (a JSON value: its nesting tracked)."""
        start = len(rest) - len(rest.lstrip()) if self.depth == 0 else 0  # not sent: spaces
        end = len(rest)
        for i in range(start, len(rest)):
            if self._scan(rest[i]):
                end = i + 1
                self.state = "tail"
                break
        self.pos += end
        piece = rest[start:end]
        if self.index is None or not piece:
            return []
        return [DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments=piece))]

    def _scan(self, char: str) -> bool:
        """Whether `char` ends the arguments' JSON object or array."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False
