"""OpenAI's Responses API bodies (`POST /v1/responses`, the subset attnserve serves) as pydantic
models: the request (`input` as text or as message / function_call / function_call_output items,
`instructions`, function `tools`), the response object and its output items.

Requests are `RequestBody`s (strict types, undeclared fields kept for `RESPONSES_FIELD_RULES` and
`request_fields` to judge). A built-in tool (web_search, file_search, ...) is refused by its type.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from attnserve.entrypoints.openai.protocol import ChatResponseMessage, UsageInfo
from attnserve.entrypoints.openai.protocol_structured import FUNCTION_NAME
from attnserve.entrypoints.openai.request_body import RequestBody, Text
from attnserve.entrypoints.openai.request_fields import FieldRule


def _is_null(value: Any) -> bool:
    return value is None


def _not_true(value: Any) -> bool:
    return value is None or value is False


def _any(value: Any) -> bool:
    return True


RESPONSES_FIELD_RULES: dict[str, FieldRule] = {
    "store": FieldRule(_not_true, "responses are not stored: send store: false"),
    "previous_response_id": FieldRule(
        _is_null, "responses are not stored: send the whole conversation as input"
    ),
    "conversation": FieldRule(_is_null, "conversations are not stored"),
    "background": FieldRule(_not_true, "background responses are not implemented"),
    "reasoning": FieldRule(_is_null, "reasoning settings (effort, summary) are not implemented"),
    "include": FieldRule(lambda v: not v, "extra output data (include) is not implemented"),
    "prompt": FieldRule(_is_null, "stored prompt templates are not implemented"),
    "max_tool_calls": FieldRule(_is_null, "a tool-call budget is not implemented"),
    "top_logprobs": FieldRule(lambda v: not v, "logprobs in responses are not implemented"),
    "truncation": FieldRule(
        lambda v: v in (None, "disabled"), "the input is never truncated: send 'disabled'"
    ),
    "metadata": FieldRule(_any, "echoed, not stored"),
}


class InputText(RequestBody):
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image, a file or audio refused by its type (the served models read text)."""
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(f"content part type {kind!r} is not supported: text only")
        return content

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(RequestBody):
    """An earlier call of the assistant (for the tool-result round trip)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(RequestBody):
    """A tool's answer to an earlier call."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text


class ReasoningItem(RequestBody):
    """An earlier reply's thinking, sent back with its output (`input += response.output`):
    dropped, as chat templates drop earlier turns' thinking."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestBody):
    type: Literal["function"]
    name: Text


class TextFormat(RequestBody):
    """The output's format: text, any JSON object, or JSON following `schema_`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("output", pattern=FUNCTION_NAME)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class TextConfig(RequestBody):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: Text | None = Field(None, description="the served model name (default: it)")
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(
        None, ge=1, description="default: the rest of the context"
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema")
    user: Text | None = Field(None, description="an end-user id: logged, nothing else")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        """A built-in tool (web_search, file_search, ...) refused by its type."""
        for tool in tools if isinstance(tools, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool type {kind!r} is not supported: only function tools")
        return tools


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class OutputReasoning(BaseModel):
    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "completed"
    call_id: str
    name: str
    arguments: str


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, info: UsageInfo) -> ResponseUsage:
        """The Responses API's names for a chat reply's token counts."""
        return cls(
            input_tokens=info.prompt_tokens,
            output_tokens=info.completion_tokens,
            total_tokens=info.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    usage: ResponseUsage | None = None

    def finish(self, finish_reason: str | None, usage: UsageInfo) -> ItemStatus:
        """Done: its status (incomplete when cut at max_output_tokens) and usage; the status
        its last output item takes."""
        self.usage = ResponseUsage.of(usage)
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return "incomplete"
        self.status = "completed"
        return "completed"


def output_items(message: ChatResponseMessage, status: ItemStatus) -> list[OutputItem]:
    """A reply's output items: its thinking, its text (also when empty, unless it calls a
    tool), then its function calls."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        thought = [ReasoningText(text=message.reasoning_content)]
        items.append(OutputReasoning(status=status, content=thought))
    if message.content or not message.tool_calls:
        text = [OutputText(text=message.content or "")]
        items.append(OutputMessage(status=status, content=text))
    items += [
        OutputFunctionCall(
            call_id=call.id, name=call.function.name, arguments=call.function.arguments
        )
        for call in message.tool_calls or []
    ]
    return items
