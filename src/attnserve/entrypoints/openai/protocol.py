"""The OpenAI API's request and response bodies as pydantic models (the subset attnserve serves).

Requests are validated here, strictly by type (an integer field takes no 2.5, "3" or true; a
boolean takes no 1; a number takes no string) and by range, each violation a 400 naming the
field; what depends on the model (the name, the prompt's length against `max_model_len`) is
checked by the serving layer (404 / 400). Floats must be finite and strings valid Unicode, so
nothing malformed reaches the engine. Fields a request model does not declare are kept
(`model_extra`) for `request_fields` to judge: accepted without effect, or refused by name.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Strict, field_validator

from attnserve.entrypoints.openai.protocol_chat_template import ChatTemplateFields
from attnserve.entrypoints.openai.protocol_structured import (
    DeltaToolCall,
    StructuredOutputsFields,
    ToolCall,
    ToolFields,
)
from attnserve.entrypoints.openai.request_body import RequestBody, Text
from attnserve.sampling_params import MAX_LOGIT_BIAS

MAX_N = 16  # completions per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_TOP_K = 1 << 20


TokenIds = Annotated[list[int], Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
# JSON object keys are strings: a logit_bias key is a token id written as one
BiasKey = Annotated[int, Strict(False), Field(ge=0)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage on every chunk (vLLM)")


class SamplingRequest(StructuredOutputsFields):
    """The sampling fields both endpoints share: OpenAI's, then vLLM's extras (structured
    outputs' fields come from `StructuredOutputsFields`)."""

    model: Text | None = Field(None, description="the served model name (default: it)")
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K, description="0 or -1: disabled")
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[BiasKey, Bias] | None = Field(None, description="token id -> -100..100")
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="an end-user id: logged, nothing else")
    # vLLM's extras
    repetition_penalty: float = Field(1.0, gt=0, description="> 1 discourages repeats")
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, description="per prompt token (not streamed)")
    truncate_prompt_tokens: int | None = Field(None, description="keep the prompt's last k tokens")
    priority: int = Field(0, description="lower runs earlier (--scheduling-policy priority)")
    request_id: Text | None = Field(None, description="the response id's suffix; unique in flight")
    return_tokens_as_token_ids: bool = Field(False, description='logprob tokens as "token_id:N"')

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's `continuous_usage_stats`)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | (Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    )
    max_tokens: int | None = Field(16, ge=1, description="default 16")
    logprobs: int | None = Field(None, ge=0, description="at most --max-logprobs")
    echo: bool = Field(False, description="the prompt (and its logprobs) before each completion")
    best_of: int | None = Field(
        None, ge=1, le=MAX_N, description="candidates drawn; the n best by cumulative logprob"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _at_most_max_prompts(cls, prompt: Any) -> Any:
        """Too many prompts said plainly (the union's four members would each complain)."""
        is_batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        if is_batch and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
        return prompt


class TextPart(RequestBody):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool message: the call it answers
    reasoning_content: Text | None = None  # an assistant's earlier thinking (for the template)

    @property
    def has_content(self) -> bool:
        """Content, or (an assistant's) tool calls in its place."""
        return self.content is not None or bool(self.tool_calls)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest, ToolFields, ChatTemplateFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="overrides max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="at most --max-logprobs")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One prompt position's entry for one token (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsJson = list[dict[int, PromptLogprob] | None]  # per prompt token; None first


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsJson | None = None  # vLLM's


def _created() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbEntry(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # the thinking (--reasoning-parser)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsJson | None = None  # vLLM's: the one prompt's


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "attnserve"
    root: str | None = None  # a LoRA adapter's path
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class VersionResponse(BaseModel):
    version: str  # attnserve's
