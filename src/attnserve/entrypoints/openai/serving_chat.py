"""`POST /v1/chat/completions`: the conversation rendered with the tokenizer's chat template,
n replies, whole or streamed as `chat.completion.chunk` events (a role delta first)."""

from __future__ import annotations

from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.core import TokenLogprobs
from attnserve.entrypoints.openai.errors import ApiError
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
    ChunkRenderer,
    Delta,
    OpenAIServing,
    finite,
    new_id,
    usage,
)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> ChatCompletionResponse | StreamingResponse:
        request_id = new_id("chatcmpl")
        self.check_request(request, request_id)
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompt = self._render(request.messages)
        k = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self.sampling_params(request, len(prompt), max_tokens, k)
        stream = self.generate([prompt], params, request_id)
        chunks = _ChunkRenderer(self, request, request_id, [prompt]) if request.stream else None

        def build(choices: list[Choice], tokens: int) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[
                    ChatChoice(
                        index=i,
                        message=ChatResponseMessage(content=c.text),
                        logprobs=None if k is None else self.logprobs(c.token_ids, c.logprobs, k),
                        finish_reason=c.finish_reason,
                    )
                    for i, c in enumerate(choices)
                ],
                usage=usage([prompt], tokens),
            )

        return await self.respond(raw, stream, chunks, request.n, build)

    def _render(self, messages: list[ChatMessage]) -> list[int]:
        """The conversation through the chat template, as prompt token ids."""
        for i, m in enumerate(messages):
            if not m.has_content:
                problem = f"messages.{i} has no content (a message needs content or tool_calls)"
                raise ApiError(400, problem, f"messages.{i}.content")
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
        except (TemplateError, ValueError) as error:
            message = f"the chat template refused the messages: {error}"
            raise ApiError(400, message, "messages") from error
        ids = self.encode(str(text), "messages")
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
    ) -> None:
        super().__init__(serving.model_name, request_id, prompts, request)
        self.serving = serving
        self.request = request
        self.started: set[int] = set()

    def render(self, deltas: list[Delta]) -> list[ChatCompletionChunk]:
        chunks = []
        for delta in deltas:
            if delta.index not in self.started:
                self.started.add(delta.index)
                role = ChatStreamChoice(
                    index=delta.index, delta=DeltaMessage(role="assistant", content="")
                )
                chunks.append(self.choice_chunk(role, delta.index, 0))
            logprobs = None
            if self.request.logprobs and delta.logprobs is not None:
                k = self.request.top_logprobs or 0
                logprobs = self.serving.logprobs(delta.token_ids, delta.logprobs, k)
            choice = ChatStreamChoice(
                index=delta.index,
                delta=DeltaMessage(content=delta.text),
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
            )
            chunks.append(self.choice_chunk(choice, delta.index, len(delta.token_ids)))
        return chunks
