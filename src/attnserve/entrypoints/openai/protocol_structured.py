"""The request and response bodies of structured outputs and tool calling (OpenAI's shapes, and
vLLM's `structured_outputs` extra field), as pydantic models the endpoints' models include.

`StructuredOutputsFields` (both endpoints): OpenAI's `response_format`, vLLM 0.26's
`structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, still sent by many clients, served as the same constraints. `ToolFields` (chat):
`tools`, `tool_choice`, `parallel_tool_calls`. The request parts are `RequestBody`s (strict types,
like every request field); the streamed deltas are response-only.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from attnserve.entrypoints.openai.request_body import RequestBody, Text

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class JsonSchemaFormat(RequestBody):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="always so: the output follows the schema")

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestBody):
    """vLLM's `structured_outputs` extra field (`StructuredOutputsParams`' names)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="JSON is compact unless false (free whitespace)"
    )
    whitespace_pattern: Text | None = None


class StructuredOutputsFields(RequestBody):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = Field(None, description="structured_outputs.json")
    guided_regex: Text | None = Field(None, description="structured_outputs.regex")
    guided_choice: list[Text] | None = Field(None, description="structured_outputs.choice")
    guided_grammar: Text | None = Field(None, description="structured_outputs.grammar")


class FunctionDefinition(RequestBody):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema (no parameters: an empty object)."""
        return self.parameters or {"type": "object", "properties": {}}


class ChatCompletionTool(RequestBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: Text


class NamedToolChoice(RequestBody):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(RequestBody):
    tools: list[ChatCompletionTool] | None = Field(None, min_length=1)
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, else none")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply")


class FunctionCall(RequestBody):
    name: Text
    arguments: Text  # JSON text


class ToolCall(RequestBody):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        """As chat templates take it: arguments as an object where they parse as one."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
