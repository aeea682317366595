"""`POST /v1/chat/completions`: the conversation rendered with the tokenizer's chat template
(with the request's tools, the assistant's earlier tool calls and the tools' answers), n replies,
whole or streamed as `chat.completion.chunk` events (a role delta first), each read for tool
calls as the request's `ToolPlan` says. With a `--reasoning-parser`, each reply's thinking is split
from it first (`reasoning_content`); the chat-template fields shape the prompt (`chat_template`)."""

from __future__ import annotations

import time
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.chat_template import TemplateOptions, template_options
from attnserve.entrypoints.openai.chunk_renderer import ChunkRenderer, usage
from attnserve.entrypoints.openai.deltas import Choice, Delta, finite, top_k
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
    PromptLogprobsJson,
)
from attnserve.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from attnserve.entrypoints.openai.replies import respond
from attnserve.entrypoints.openai.serving_engine import OpenAIServing
from attnserve.entrypoints.openai.serving_models import OpenAIServingModels
from attnserve.entrypoints.openai.tool_choice import ToolPlan, tool_plan
from attnserve.entrypoints.openai.tool_parsers import ToolCallStream, merged_calls
from attnserve.entrypoints.openai.vllm_fields import (
    prompt_logprobs_json,
    shown_token,
    truncated,
)
from attnserve.outputs import SampleLogprobs
from attnserve.sampling_params import SamplingParams


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
    if message.reasoning_content is not None:
        entry["reasoning_content"] = message.reasoning_content
    return entry


def render_messages(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    options: TemplateOptions | None = None,
) -> str:
    """The conversation (and the tools) through the chat template (the request's own, if
    `options` has one), as prompt text (also what /tokenize counts); 400 for a message without
    content or what the template refuses."""
    for i, m in enumerate(messages):
        if not m.has_content:
            problem = f"messages.{i} has no content (a message needs content or tool_calls)"
            raise ApiError(400, problem, f"messages.{i}.content")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions")
    options = options or TemplateOptions()
    conversation = [_template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            documents=options.documents,
            chat_template=options.chat_template,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.kwargs,
        )
    except TemplateSyntaxError as error:
        param = "messages" if options.chat_template is None else "chat_template"
        raise ApiError(400, f"the chat template does not compile: {error}", param) from error
    except (TemplateError, ValueError, TypeError) as error:
        message = f"the chat template refused the messages: {error}"
        raise ApiError(400, message, "messages") from error
    return str(text)


class OpenAIServingChat(OpenAIServing):
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    trust_request_chat_template = False  # --trust-request-chat-template

    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: OpenAIServingModels,
        metrics: ServerMetrics,
        pool: PreprocessPool,
        tool_call_parser: str | None = None,
    ) -> None:
        """`tool_call_parser`: the server's parser for "auto" tool choice (None: the server's
        own tool-call format, `generic_tools`)."""
        super().__init__(engine, models, metrics, pool)
        self.tool_call_parser = tool_call_parser

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        received = time.monotonic()
        request_id = self.accept(request, "chatcmpl")
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = (request.top_logprobs or 0) if request.logprobs else None
        plan, prompt, params, thinking = await self.off_loop(raw, self._prepare, request, k)
        stream = self.generate(request, [prompt], params, request_id, received)
        chunks = None
        if request.stream:
            chunks = _ChunkRenderer(self, request, request_id, [prompt], plan, thinking)

        def build(choices: list[Choice], tokens: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id,
                model=request.model or self.model_name,  # a LoRA adapter's name, as vLLM
                choices=[
                    self._choice(i, c, k, plan, thinking, request.return_tokens_as_token_ids)
                    for i, c in enumerate(choices)
                ],
                usage=usage([prompt], tokens),
                prompt_logprobs=self._prompt_logprobs(request, choices),
            )

        return await respond(raw, stream, chunks, request.n, build, self.metrics.breakdown)

    def _prompt_logprobs(
        self, request: ChatCompletionRequest, choices: list[Choice]
    ) -> PromptLogprobsJson | None:
        """The prompt's log-probabilities, when asked for (vLLM's, on the response)."""
        if request.prompt_logprobs is None:
            return None
        entries = next((c.prompt_logprobs for c in choices if c.prompt_logprobs), None)
        return prompt_logprobs_json(entries, self.token_text)

    def _choice(
        self,
        index: int,
        choice: Choice,
        k: int | None,
        plan: ToolPlan,
        thinking: bool | None,
        as_ids: bool,
    ) -> ChatChoice:
        """A whole reply, its thinking (`thinking`: None, no reasoning parser; else whether it
        starts inside it) and its tool calls read out of it."""
        reasoning = None if thinking is None else ReasoningStream(thinking)
        thought, text = reasoning.feed(choice.text, final=True) if reasoning else ("", choice.text)
        thought_out = thought if reasoning is not None and reasoning.thought else None
        reader = plan.new_stream()
        content, deltas = reader.feed(text, final=True)
        calls = merged_calls(deltas)
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(
                content=(content or None) if calls or thought_out is not None else content,
                reasoning_content=thought_out,
                tool_calls=calls or None,
            ),
            logprobs=(
                None if k is None else self.logprobs(choice.token_ids, choice.logprobs, k, as_ids)
            ),
            finish_reason=plan.finish_reason(reader, choice.finish_reason),
        )

    def _prepare(
        self, request: ChatCompletionRequest, k: int | None
    ) -> tuple[ToolPlan, list[int], SamplingParams, bool | None]:
        """The request's tool plan, prompt token ids, sampling parameters (400 for what they
        refuse) and whether its replies start inside their thinking (None: no reasoning
        parser): the request's CPU work, on the preprocessing pool."""
        last_role = request.messages[-1].role if request.messages else None
        options = template_options(request, last_role, self.trust_request_chat_template)
        template = options.chat_template or getattr(self.tokenizer, "chat_template", None)
        plan = tool_plan(request, self.tool_call_parser, str(template or ""))
        messages = plan.messages(request.messages)
        text = render_messages(self.tokenizer, messages, plan.template_tools, options)
        prompt = self.encode(text, "messages", request.truncate_prompt_tokens is not None)
        prompt = truncated(prompt, request)
        self.check_prompt(prompt, "messages")
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(
            request,
            len(prompt),
            max_tokens,
            k,
            prompt_logprobs=request.prompt_logprobs,
            tool_constraint=plan.constraint,
        )
        parser = self.reasoning_parser
        return plan, prompt, params, None if parser is None else parser.thinks_first(text)

    def logprobs(
        self, token_ids: list[int], logprobs: SampleLogprobs, k: int, as_ids: bool
    ) -> ChatLogProbs:
        """`as_ids`: tokens named "token_id:N" (`return_tokens_as_token_ids`)."""
        entries = []
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            drawn = candidates.get(token_id)
            chosen = self._logprob(token_id, None if drawn is None else drawn.logprob, as_ids)
            top = [self._logprob(t, lp, as_ids) for t, lp in top_k(candidates, k)]
            entries.append(ChatLogProbEntry(**chosen.model_dump(), top_logprobs=top))
        return ChatLogProbs(content=entries)

    def _logprob(self, token_id: int, logprob: float | None, as_ids: bool) -> ChatLogProb:
        text = shown_token(token_id, self.token_text(token_id), as_ids)
        return ChatLogProb(token=text, logprob=finite(logprob), bytes=list(text.encode()))


class _ChunkRenderer(ChunkRenderer[ChatCompletionChunk]):
    """Streamed chunks of one request: a role delta before each choice's first content; with a
    reasoning parser, each choice's thinking as `reasoning_content` deltas, then its content."""

    chunk_type = ChatCompletionChunk

    def __init__(
        self,
        serving: OpenAIServingChat,
        request: ChatCompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        plan: ToolPlan,
        thinking: bool | None,
    ) -> None:
        """`thinking`: None without a reasoning parser; else whether replies start inside it."""
        super().__init__(request.model or serving.model_name, request_id, prompts, request)
        self.serving = serving
        self.request = request
        self.plan = plan
        self.thinking = thinking
        self.readers: dict[int, ToolCallStream] = {}  # per choice, from its first delta
        self.reasoning: dict[int, ReasoningStream] = {}  # per choice, with a reasoning parser

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
                if self.thinking is not None:
                    self.reasoning[delta.index] = ReasoningStream(self.thinking)
            final = delta.finish_reason is not None
            thought, text = self._split(delta.index, delta.text, final)
            content, calls = reader.feed(text, final=final)
            logprobs = None
            if self.request.logprobs and delta.logprobs is not None:
                k = self.request.top_logprobs or 0
                as_ids = self.request.return_tokens_as_token_ids
                logprobs = self.serving.logprobs(delta.token_ids, delta.logprobs, k, as_ids)
            if not (thought or content or calls or logprobs or delta.finish_reason):
                self.count_tokens(delta.index, len(delta.token_ids))
                continue  # held back (a tool call's text, a tag), or nothing shown yet
            message = DeltaMessage(content=content if content or not (calls or thought) else None)
            message.reasoning_content = thought or None
            message.tool_calls = calls or None
            choice = ChatStreamChoice(
                index=delta.index,
                delta=message,
                logprobs=logprobs,
                finish_reason=self.plan.finish_reason(reader, delta.finish_reason),
            )
            chunks.append(self.choice_chunk(choice, delta.index, len(delta.token_ids)))
        return chunks

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(thinking, the rest) of choice `index`'s new text (no thinking without a parser)."""
        reasoning = self.reasoning.get(index)
        return reasoning.feed(text, final) if reasoning is not None else ("", text)
