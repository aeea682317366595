"""The request and response bodies of `POST /tokenize` and `POST /detokenize` (vLLM's routes, with
vLLM's names, fields and defaults), as pydantic models.

`TokenizeRequest` is either body, told apart by its `messages` field: a completion-style one
(`TokenizeCompletionRequest`: a `prompt` string) or a chat-style one (`TokenizeChatRequest`:
`messages`, `tools` and the chat-template fields, as `/v1/chat/completions` takes them).
Requests are `RequestBody`s (strict types, undeclared fields kept for `request_fields` to
judge), like every request here.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Field, Tag

from attnserve.entrypoints.openai.protocol import ChatMessage, TokenId
from attnserve.entrypoints.openai.protocol_chat_template import ChatTemplateFields
from attnserve.entrypoints.openai.protocol_structured import ChatCompletionTool
from attnserve.entrypoints.openai.request_body import RequestBody, Text


class TokenizeCompletionRequest(RequestBody):
    model: Text | None = Field(None, description="the served model name (default: it)")
    prompt: Text
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (BOS)")
    return_token_strs: bool | None = Field(False, description="also each token's string")


class TokenizeChatRequest(ChatTemplateFields):
    model: Text | None = Field(None, description="the served model name (default: it)")
    messages: list[ChatMessage]
    return_token_strs: bool | None = Field(False, description="also each token's string")
    add_special_tokens: bool = Field(
        False, description="special tokens (BOS) on top of the chat template's own"
    )
    tools: list[ChatCompletionTool] | None = Field(None, min_length=1)


def _request_kind(body: Any) -> str | None:
    """Which kind of tokenize request a JSON body (or a body validated already, off the event
    loop) is: chat-style when it has `messages`; None (refused) when it is not an object."""
    if isinstance(body, BaseModel):
        return "tokenize-chat" if isinstance(body, TokenizeChatRequest) else "tokenize-completion"
    if not isinstance(body, dict):
        return None
    return "tokenize-chat" if "messages" in body else "tokenize-completion"


# The tags are not identifiers, so a validation error names the field alone (errors._is_field).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("tokenize-completion")]
    | Annotated[TokenizeChatRequest, Tag("tokenize-chat")],
    Discriminator(
        _request_kind,
        custom_error_type="invalid_union",
        custom_error_message="the body must be an object: with prompt, or with messages",
    ),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: Text | None = Field(None, description="the served model name (default: it)")
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
