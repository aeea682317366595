"""`POST /v1/responses` (OpenAI's Responses API, text in and out, function tools): the request
becomes the chat request it stands for (`instructions` a system message first, the input items
its messages, the earlier function calls and their outputs the assistant's tool calls and the
tools' answers) and is served by `OpenAIServingChat`, so the chat template, the tool plan
(`tool_choice`, the tool-call parser), the reasoning parser and every limit are the same; the
reply becomes a `response` object, or with `stream: true` the Responses API's events
(`responses_events`). Fields this server cannot serve (stored responses, built-in tools,
background runs, reasoning settings) are refused by name (400).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    StreamOptions,
)
from attnserve.entrypoints.openai.protocol_responses import (
    RESPONSES_FIELD_RULES,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunctionChoice,
    ResponseObject,
    ResponsesRequest,
    TextFormat,
    output_items,
)
from attnserve.entrypoints.openai.protocol_structured import (
    ChatCompletionTool,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
)
from attnserve.entrypoints.openai.request_fields import FIELD_RULES, unsupported_field
from attnserve.entrypoints.openai.responses_events import ResponseEvents
from attnserve.entrypoints.openai.serving_chat import OpenAIServingChat

_RULES = {**FIELD_RULES, **RESPONSES_FIELD_RULES}
_CHAT_PARAMS = {  # a chat field named in an error -> the Responses field it came from
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.json_schema.schema": "text.format.schema",
}


class OpenAIServingResponses:
    """The Responses API over the server's chat endpoint."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(
        self, request: ResponsesRequest, raw: Request
    ) -> ResponseObject | StreamingResponse:
        refused = unsupported_field(request, _RULES)
        if refused is not None:
            raise ApiError(400, refused[1], refused[0], "unsupported_parameter")
        shell = _shell(request, self.chat.model_name)
        try:
            chat = await self.chat.off_loop(raw, chat_request, request)  # as large as the body
            answer = await self.chat.create_chat_completion(chat, raw)
        except ApiError as error:
            error.param = _responses_param(error.param, request)
            raise
        if isinstance(answer, StreamingResponse):
            events = ResponseEvents(shell).translate(answer.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream")
        return finished(shell, answer)


def _shell(request: ResponsesRequest, model_name: str) -> ResponseObject:
    """The response object before any output: the request's settings echoed."""
    tool_choice: Any = request.tool_choice or ("auto" if request.tools else "none")
    if isinstance(tool_choice, NamedFunctionChoice):
        tool_choice = tool_choice.model_dump()
    shell = ResponseObject(
        model=model_name,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        tool_choice=tool_choice,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
        metadata=(request.model_extra or {}).get("metadata"),
        user=request.user,
    )
    if request.text is not None:
        shell.text = request.text.model_dump(exclude_none=True, by_alias=True)
    return shell


def _responses_param(param: str | None, request: ResponsesRequest) -> str | None:
    """The Responses field a chat field named in an error came from ("auto" tool choice, the
    default with tools, is `tools` when the request did not ask for it)."""
    if param is None or param.startswith("messages"):
        return None if param is None else "input"
    if param == "tool_choice" and request.tool_choice is None:
        return "tools"
    return _CHAT_PARAMS.get(param, param)


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request.instructions, request.input),
        "max_completion_tokens": request.max_output_tokens,
        "stream": request.stream,
        "user": request.user,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.stream:
        fields["stream_options"] = StreamOptions(include_usage=True, continuous_usage_stats=False)
    if request.temperature is not None:
        fields["temperature"] = request.temperature
    if request.top_p is not None:
        fields["top_p"] = request.top_p
    if request.tools:
        fields["tools"] = [
            ChatCompletionTool(
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
            )
            for t in request.tools
        ]
    text_format = request.text.format if request.text else None
    if text_format is not None:
        fields["response_format"] = _response_format(text_format)
    choice = request.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        fields["tool_choice"] = NamedToolChoice(function=NamedFunction(name=choice.name))
    elif choice is not None:
        fields["tool_choice"] = choice
    return ChatCompletionRequest(**fields)


def _response_format(text_format: TextFormat) -> ResponseFormat:
    """The chat request's `response_format` for a Responses `text.format`."""
    if text_format.type != "json_schema":
        return ResponseFormat(type=text_format.type)
    if text_format.schema_ is None:
        raise ApiError(400, "text.format json_schema needs its schema", "text.format.schema")
    schema = JsonSchemaFormat(
        name=text_format.name, schema=text_format.schema_, strict=text_format.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_messages(instructions: str | None, items: str | list[InputItem]) -> list[ChatMessage]:
    """The conversation: the instructions as a system message, then the input items (a string
    is one user message; consecutive function calls are one assistant message's tool calls;
    earlier reasoning items are dropped)."""
    messages = [] if instructions is None else [ChatMessage(role="system", content=instructions)]
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            answer = ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            messages.append(answer)
    return messages


def finished(shell: ResponseObject, answer: ChatCompletionResponse) -> ResponseObject:
    """The whole response from the chat reply."""
    choice = answer.choices[0]
    status = shell.finish(choice.finish_reason, answer.usage)
    shell.output = output_items(choice.message, status)
    return shell
