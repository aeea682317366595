"""`POST /v1/completions`: one or more prompts (text or token ids), n completions each, whole or
streamed as server-sent events, with OpenAI's legacy log-probability format."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.core import TokenLogprobs
from attnserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
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


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw: Request
    ) -> CompletionResponse | StreamingResponse:
        self.check_model(request.model)
        prompts = [self._prompt_ids(p) for p in _prompt_list(request.prompt)]
        longest = max(len(p) for p in prompts)
        params = self.sampling_params(request, longest, request.max_tokens, request.logprobs)
        request_id = new_id("cmpl")
        stream = self.generate(prompts, params, request_id)
        chunks = _ChunkRenderer(self, request, request_id, prompts) if request.stream else None

        def build(choices: list[Choice], tokens: int) -> CompletionResponse:
            return CompletionResponse(
                id=request_id,
                model=self.model_name,
                choices=[self._choice(i, c, request.logprobs) for i, c in enumerate(choices)],
                usage=usage(prompts, tokens),
            )

        return await self.respond(raw, stream, chunks, len(prompts) * request.n, build)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt
        self.check_prompt(ids, "prompt")
        return ids

    def _choice(self, index: int, choice: Choice, k: int | None) -> CompletionChoice:
        logprobs = None
        if k is not None:
            logprobs = self.logprobs(choice.token_ids, choice.logprobs, k, 0)
        return CompletionChoice(
            index=index, text=choice.text, logprobs=logprobs, finish_reason=choice.finish_reason
        )

    def logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs], k: int, offset: int
    ) -> CompletionLogProbs:
        """The legacy format; `offset` is where these tokens' text starts in the choice."""
        result = CompletionLogProbs()
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token_id)
            best = sorted(candidates.items(), key=lambda item: -item[1])[:k]
            result.tokens.append(text)
            result.token_logprobs.append(finite(candidates.get(token_id)))
            result.top_logprobs.append({self.token_text(t): finite(lp) for t, lp in best})
            result.text_offset.append(offset)
            offset += len(text)
        return result


class _ChunkRenderer(ChunkRenderer[CompletionResponse]):
    """Streamed chunks of one request, keeping each choice's text offset for its log-probs."""

    chunk_type = CompletionResponse

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
    ) -> None:
        super().__init__(serving.model_name, request_id, prompts, request.include_usage)
        self.serving = serving
        self.request = request
        self.offsets = [0] * (len(prompts) * request.n)

    def render(self, deltas: list[Delta]) -> list[CompletionResponse]:
        chunks = []
        for delta in deltas:
            logprobs = None
            if self.request.logprobs is not None and delta.logprobs is not None:
                offset = self.offsets[delta.index]
                logprobs = self.serving.logprobs(
                    delta.token_ids, delta.logprobs, self.request.logprobs, offset
                )
            self.offsets[delta.index] += len(delta.text)
            choice = CompletionChoice(
                index=delta.index,
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
            )
            chunks.append(self.chunk([choice]))
        return chunks


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
