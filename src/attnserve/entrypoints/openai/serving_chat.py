"""`POST /v1/chat/completions`: the conversation rendered with the tokenizer's chat template
(with the request's tools, the assistant's earlier tool calls and the tools' answers), n replies,
whole or streamed as `chat.completion.chunk` events (a role delta first), each read for tool
calls as the request's `ToolPlan` says."""

from __future__ import annotations

import time
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.chunk_renderer import ChunkRenderer, usage
from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.preprocess import PreprocessPool
from attnserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbEntry,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from attnserve.entrypoints.openai.serving_engine import (
    Choice,
    Delta,
    OpenAIServing,
    finite,
    new_id,
)
from attnserve.entrypoints.openai.structured import constraint_field
from attnserve.entrypoints.openai.tool_choice import ToolPlan, tool_plan
from attnserve.entrypoints.openai.tool_parsers import ToolCallStream, merged_calls
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import TokenLogprobs


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (tool calls' arguments as objects)."""
    entry: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        entry["tool_calls"] = [call.template_dict() for call in message.tool_calls]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None and message.role == "tool":
        entry["name"] = message.name
    return entry


def render_messages(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The conversation (and the tools) through the chat template, as prompt text (also what
    /tokenize counts); 400 for a message without content or what the template refuses."""
    for i, m in enumerate(messages):
        if not m.has_content:
            problem = f"messages.{i} has no content (a message needs content or tool_calls)"
            raise ApiError(400, problem, f"messages.{i}.content")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions")
    conversation = [_template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (TemplateError, ValueError, TypeError) as error:
        message = f"the chat template refused the messages: {error}"
        raise ApiError(400, message, "messages") from error
    return str(text)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        metrics: ServerMetrics,
        tool_call_parser: str | None = None,
        pool: PreprocessPool | None = None,
    ) -> None:
        """`tool_call_parser`: the server's parser for "auto" tool choice (None: refused)."""
        super().__init__(engine, model_name, metrics, pool)
        self.tool_call_parser = tool_call_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        received = time.monotonic()
        request_id = new_id("chatcmpl")
        self.check_request(request, request_id)
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = (request.top_logprobs or 0) if request.logprobs else None
        plan, prompt, params = await self.off_loop(raw, self._prepare, request, k)
        stream = self.generate([prompt], params, request_id, received, constraint_field(request))
        chunks = None
        if request.stream:
            chunks = _ChunkRenderer(self, request, request_id, [prompt], plan)

        def build(choices: list[Choice], tokens: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[self._choice(i, c, k, plan) for i, c in enumerate(choices)],
                usage=usage([prompt], tokens),
            )

        return await self.respond(raw, stream, chunks, request.n, build)

    def _choice(self, index: int, choice: Choice, k: int | None, plan: ToolPlan) -> ChatChoice:
        """A whole reply, its tool calls read out of it."""
        reader = plan.new_stream()
        content, deltas = reader.feed(choice.text, final=True)
        calls = merged_calls(deltas)
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(
                content=(content or None) if calls else content, tool_calls=calls or None
            ),
            logprobs=None if k is None else self.logprobs(choice.token_ids, choice.logprobs, k),
            finish_reason=plan.finish_reason(reader, choice.finish_reason),
        )

    def _prepare(
        self, request: ChatCompletionRequest, k: int | None
    ) -> tuple[ToolPlan, list[int], SamplingParams]:
        """The request's tool plan, prompt token ids and sampling parameters (400 for what they
        refuse): the request's CPU work, on the preprocessing pool."""
        plan = tool_plan(request, self.tool_call_parser)
        prompt = self._render(request.messages, plan.template_tools)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(
            request, len(prompt), max_tokens, k, tool_constraint=plan.constraint
        )
        return plan, prompt, params

    def _render(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> list[int]:
        """The conversation (and the tools) through the chat template, as prompt token ids."""
        ids = self.encode(render_messages(self.tokenizer, messages, tools), "messages")
        self.check_prompt(ids, "messages")
        return ids

    def logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs], k: int) -> ChatLogProbs:
        entries = []
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            best = sorted(candidates.items(), key=lambda item: -item[1])[:k]
            chosen = self._logprob(token_id, candidates.get(token_id))
            top = [self._logprob(t, lp) for t, lp in best]
            entries.append(ChatLogProbEntry(**chosen.model_dump(), top_logprobs=top))
        return ChatLogProbs(content=entries)

    def _logprob(self, token_id: int, logprob: float | None) -> ChatLogProb:
        text = self.token_text(token_id)
        return ChatLogProb(token=text, logprob=finite(logprob), bytes=list(text.encode()))


class _ChunkRenderer(ChunkRenderer[ChatCompletionChunk]):
    """Streamed chunks of one request: a role delta before each choice's first content."""

    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        serving: OpenAIServingChat,
        request: ChatCompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        plan: ToolPlan,
    ) -> None:
        super().__init__(serving.model_name, request_id, prompts, request)
        self.serving = serving
        self.request = request
        self.plan = plan
        self.readers: dict[int, ToolCallStream] = {}  # per choice, from its first delta

    def render(self, deltas: list[Delta]) -> list[str]:
        chunks = []
        for delta in deltas:
            reader = self.readers.get(delta.index)
            if reader is None:
                reader = self.readers[delta.index] = self.plan.new_stream()
                role = ChatStreamChoice(
                    index=delta.index, delta=DeltaMessage(role="assistant", content="")
                )
                chunks.append(self.choice_chunk(role, delta.index, 0))
            content, calls = reader.feed(delta.text, final=delta.finish_reason is not None)
            logprobs = None
            if self.request.logprobs and delta.logprobs is not None:
                k = self.request.top_logprobs or 0
                logprobs = self.serving.logprobs(delta.token_ids, delta.logprobs, k)
            if not (content or calls or logprobs or delta.finish_reason):
                self.count_tokens(delta.index, len(delta.token_ids))
                continue  # held back (a tool call's text), or nothing shown yet
            message = DeltaMessage(content=content if content or not calls else None)
            message.tool_calls = calls or None
            choice = ChatStreamChoice(
                index=delta.index,
                delta=message,
                logprobs=logprobs,
                finish_reason=self.plan.finish_reason(reader, delta.finish_reason),
            )
            chunks.append(self.choice_chunk(choice, delta.index, len(delta.token_ids)))
        return chunks
