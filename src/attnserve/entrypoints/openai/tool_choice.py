"""`ToolPlan`: what a chat request's `tools` and `tool_choice` mean for its prompt, its output
constraint and how its replies are read.

- no tools, or `tool_choice` "none": the tools (if any) still go to the chat template, as vLLM
  does; the reply is content;
- a named function, or "required": the output is constrained to the call(s) (see `structured`),
  read by `NamedCallStream` / `RequiredCallsStream`;
- "auto" (the default with tools): the free reply, read by the server's tool-call parser
  (`--tool-call-parser`, else the one the chat template's format calls for).

A server with no parser (the model's template shows no format it knows) uses its own format for
every tool choice but "none" (see `generic_tools`): the tools listed in a system block, the output
constrained to text or well-formed calls ("auto") or calls only ("required", a named function),
read by `GenericCallStream`. A template that never renders an assistant's `tool_calls` gets the
conversation's calls and tools' answers written in that format, whatever the tool choice.

A reply with calls whose output ended normally finishes with "tool_calls". Every refusal is a 400
naming `tool_choice`, `tools` or the tool (`tools[i].function.parameters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.generic_tools import (
    GenericCallStream,
    generic_messages,
    generic_spec,
    history_messages,
    tools_block,
)
from attnserve.entrypoints.openai.protocol import ChatMessage
from attnserve.entrypoints.openai.protocol_structured import NamedToolChoice, ToolFields
from attnserve.entrypoints.openai.structured import named_tool_spec, required_tools_spec
from attnserve.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedCallStream,
    RequiredCallsStream,
    ToolCallStream,
)
from attnserve.output_constraints import StructuredOutputsParams

Messages = Callable[[list[ChatMessage]], list[ChatMessage]]


def _as_sent(messages: list[ChatMessage]) -> list[ChatMessage]:
    return messages


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # for apply_chat_template(tools=...)
    constraint: StructuredOutputsParams | None
    new_stream: Callable[[], ToolCallStream]  # one per choice
    messages: Messages = _as_sent  # the conversation as the chat template gets it

    @staticmethod
    def finish_reason(stream: ToolCallStream, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and stream.num_calls else reason


def renders_tool_calls(template: str | None) -> bool:
    """Whether a chat template renders an assistant's `tool_calls` (else the server writes them,
    and the tools' answers, into the messages)."""
    return "tool_calls" in (template or "")


def tool_plan(
    request: ToolFields, auto_parser: str | None, template: str | None = None
) -> ToolPlan:
    """The plan of a request; `auto_parser`: the server's tool-call parser (None: the server's
    own format); `template`: the chat template's source (None: one without tool support)."""
    tools = request.tools
    choice = request.tool_choice
    history = _as_sent if renders_tool_calls(template) else history_messages
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan(None, None, ToolCallStream, history)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = request.parallel_tool_calls
    if choice == "none":
        return ToolPlan(template_tools, None, ToolCallStream, history)
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if named is not None and all(t.function.name != named for t in tools):
        raise ApiError(400, f"tool_choice names {named!r}, which is not in tools", "tool_choice")
    if auto_parser is None:
        return _generic_plan(request, named or (choice if isinstance(choice, str) else "auto"))
    if named is not None:
        index = next(i for i, t in enumerate(tools) if t.function.name == named)
        spec = named_tool_spec(tools, index)
        return ToolPlan(template_tools, spec, lambda: NamedCallStream(named), history)
    if choice == "required":
        spec = required_tools_spec(tools, parallel)
        return ToolPlan(template_tools, spec, lambda: RequiredCallsStream(parallel), history)
    parser = TOOL_CALL_PARSERS[auto_parser]
    return ToolPlan(template_tools, None, lambda: parser(parallel), history)


def _generic_plan(request: ToolFields, choice: str) -> ToolPlan:
    """The plan in the server's own format; `choice`: "auto", "required" or a function's name."""
    tools = request.tools or []
    parallel = request.parallel_tool_calls and choice in ("auto", "required")
    spec = generic_spec(tools, choice, parallel)
    block = tools_block(tools, choice, parallel)
    return ToolPlan(
        None,
        spec,
        lambda: GenericCallStream(parallel),
        lambda messages: generic_messages(messages, block),
    )
