"""`POST /v1/completions`: one or more prompts (text or token ids), n completions each, whole or
streamed as server-sent events, with OpenAI's legacy log-probability format."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from attnserve.entrypoints.openai.serving_engine import (
    Choice,
    Delta,
    OpenAIServing,
    finite,
    new_id,
    until_disconnect,
    usage,
)
from attnserve.outputs import TokenLogprobs


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
        num_choices = len(prompts) * request.n
        if request.stream:
            first = await until_disconnect(raw, anext(stream))
            chunks = _ChunkRenderer(self, request, request_id, prompts)
            events = self.sse(first, stream, chunks.render, chunks.usage_chunk)
            return StreamingResponse(events, media_type="text/event-stream")
        choices, tokens = await until_disconnect(raw, self.collect(stream, num_choices))
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=[self._choice(i, c, request.logprobs) for i, c in enumerate(choices)],
            usage=usage(prompts, tokens),
        )

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


class _ChunkRenderer:
    """Streamed chunks of one request, keeping each choice's text offset for its log-probs."""

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.offsets = [0] * (len(prompts) * request.n)

    def _response(self, choices: list[CompletionChoice]) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, model=self.serving.model_name, choices=choices
        )

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
            chunks.append(self._response([choice]))
        return chunks

    def usage_chunk(self, tokens: int) -> CompletionResponse | None:
        if not self.request.include_usage:
            return None
        return CompletionResponse(
            id=self.request_id,
            model=self.serving.model_name,
            choices=[],
            usage=usage(self.prompts, tokens),
        )


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
