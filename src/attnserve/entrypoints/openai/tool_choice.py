"""`ToolPlan`: what a chat request's `tools` and `tool_choice` mean for its prompt, its output
constraint and how its replies are read.

- no tools, or `tool_choice` "none": the tools (if any) still go to the chat template, as vLLM
  does; the reply is content;
- a named function, or "required": the output is constrained to the call(s) (see `structured`),
  read by `NamedCallStream` / `RequiredCallsStream`;
- "auto" (the default with tools): only on a server started with `--enable-auto-tool-choice`
  and a `--tool-call-parser`, which reads the free reply.

A reply with calls whose output ended normally finishes with "tool_calls". Every refusal is a 400
naming `tool_choice`, `tools` or the tool (`tools[i].function.parameters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol_structured import NamedToolChoice, ToolFields
from attnserve.entrypoints.openai.structured import named_tool_spec, required_tools_spec
from attnserve.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedCallStream,
    RequiredCallsStream,
    ToolCallStream,
)
from attnserve.structured_outputs import StructuredOutputsParams

AUTO_NEEDS_FLAGS = (
    '"auto" tool choice needs a tool-call parser, and this model\'s chat template shows no tool '
    "call format the server knows: start it with --tool-call-parser hermes (Hermes / Qwen "
    "<tool_call> blocks) or llama3_json (Llama 3.x JSON calls)"
)


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # for apply_chat_template(tools=...)
    constraint: StructuredOutputsParams | None
    new_stream: Callable[[], ToolCallStream]  # one per choice

    @staticmethod
    def finish_reason(stream: ToolCallStream, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and stream.num_calls else reason


def tool_plan(request: ToolFields, auto_parser: str | None) -> ToolPlan:
    """The plan of a request; `auto_parser`: the server's tool-call parser (None: "auto" is off)."""
    tools = request.tools
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return ToolPlan(None, None, ToolCallStream)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parallel = request.parallel_tool_calls
    if choice == "none":
        return ToolPlan(template_tools, None, ToolCallStream)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
        if index is None:
            raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        spec = named_tool_spec(tools, index)
        return ToolPlan(template_tools, spec, lambda: NamedCallStream(name))
    if choice == "required":
        spec = required_tools_spec(tools, parallel)
        return ToolPlan(template_tools, spec, lambda: RequiredCallsStream(parallel))
    if auto_parser is None:
        raise ApiError(400, AUTO_NEEDS_FLAGS, "tool_choice")
    parser = TOOL_CALL_PARSERS[auto_parser]
    return ToolPlan(template_tools, None, lambda: parser(parallel))
