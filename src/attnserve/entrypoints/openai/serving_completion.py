"""`POST /v1/completions`: one or more prompts (text or token ids), n completions each (the n
best of `best_of`), whole or streamed as server-sent events, with OpenAI's legacy
log-probability format; with `echo`, each completion is preceded by its prompt (and, with
`logprobs`, the prompt tokens' log-probabilities, the first one null). vLLM's extras
(`vllm_fields`): `prompt_logprobs` on each choice, `truncate_prompt_tokens`, `priority`,
`request_id`, `return_tokens_as_token_ids`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import StreamingResponse

from attnserve.entrypoints.openai.chunk_renderer import ChunkRenderer, usage
from attnserve.entrypoints.openai.deltas import Choice, Delta, finite, top_k
from attnserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from attnserve.entrypoints.openai.replies import respond
from attnserve.entrypoints.openai.serving_engine import OpenAIServing
from attnserve.entrypoints.openai.vllm_fields import (
    prompt_logprobs_json,
    shown_token,
    truncated,
)
from attnserve.outputs import Logprob, PromptLogprobs
from attnserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Echo:
    """What `echo` puts before the completions of each prompt: its text and token ids."""

    texts: list[str]
    prompts: list[list[int]]
    n: int  # completions per prompt


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self, request: CompletionRequest, raw: Request
    ) -> CompletionResponse | StreamingResponse:
        received = time.monotonic()
        request_id = self.accept(request, "cmpl")
        given = _prompt_list(request.prompt)
        for prompt in given:
            if isinstance(prompt, str) and request.truncate_prompt_tokens is None:
                self.check_length(prompt, "prompt")
        prompts, params, echo = await self.off_loop(raw, self._prepare, request, given)
        stream = self.generate(request, prompts, params, request_id, received)
        chunks = None
        if request.stream:
            chunks = _ChunkRenderer(self, request, request_id, prompts, echo)

        def build(choices: list[Choice], tokens: int) -> CompletionResponse:
            return CompletionResponse(
                id=request_id,
                model=request.model or self.model_name,  # a LoRA adapter's name, as vLLM
                choices=[self._choice(i, c, request, echo) for i, c in enumerate(choices)],
                usage=usage(prompts, tokens),
            )

        num_choices = len(prompts) * request.n
        return await respond(raw, stream, chunks, num_choices, build, self.metrics.breakdown)

    def _prepare(
        self, request: CompletionRequest, given: list[str | list[int]]
    ) -> tuple[list[list[int]], SamplingParams, _Echo | None]:
        """The prompts' token ids, the sampling parameters and what `echo` shows (400 for what
        they refuse): the request's CPU work, on the preprocessing pool."""
        prompts = [self._prompt_ids(p, request) for p in given]
        k = request.logprobs
        asked = [n for n in (request.prompt_logprobs, k if request.echo else None) if n is not None]
        params = self.sampling_params(
            request,
            max(len(p) for p in prompts),
            request.max_tokens,
            k,
            best_of=request.best_of,
            prompt_logprobs=max(asked, default=None),
        )
        echo = None
        if request.echo:
            texts = [p if isinstance(p, str) else self._decode(p) for p in given]
            echo = _Echo(texts, prompts, request.n)
        return prompts, params, echo

    def _prompt_ids(self, prompt: str | list[int], request: CompletionRequest) -> list[int]:
        truncating = request.truncate_prompt_tokens is not None
        ids = self.encode(prompt, "prompt", truncating) if isinstance(prompt, str) else prompt
        ids = truncated(ids, request)
        self.check_prompt(ids, "prompt")
        return ids

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode(token_ids))

    def _choice(
        self, index: int, choice: Choice, request: CompletionRequest, echo: _Echo | None
    ) -> CompletionChoice:
        text, logprobs = "", None
        k, as_ids = request.logprobs, request.return_tokens_as_token_ids
        if echo is not None:
            text, logprobs = self.echoed(echo, index, choice.prompt_logprobs, k, as_ids)
        if k is not None:
            tail = self.logprobs(choice.token_ids, choice.logprobs, k, len(text), as_ids)
            logprobs = _joined(logprobs, tail)
        shown_prompt = choice.prompt_logprobs if request.prompt_logprobs is not None else None
        return CompletionChoice(
            index=index,
            text=text + choice.text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            prompt_logprobs=prompt_logprobs_json(shown_prompt, self.token_text),
        )

    def echoed(
        self,
        echo: _Echo,
        index: int,
        prompt_logprobs: PromptLogprobs | None,
        k: int | None,
        as_ids: bool,
    ) -> tuple[str, CompletionLogProbs | None]:
        """The prompt before choice `index`: its text, and with `k` its tokens' logprobs."""
        prompt = index // echo.n
        if k is None:
            return echo.texts[prompt], None
        ids = echo.prompts[prompt]
        entries = prompt_logprobs or [None] * len(ids)
        return echo.texts[prompt], self.logprobs(ids, entries, k, 0, as_ids)

    def logprobs(
        self,
        token_ids: list[int],
        logprobs: Sequence[dict[int, Logprob] | None],
        k: int,
        offset: int,
        as_ids: bool,
    ) -> CompletionLogProbs:
        """The legacy format; `offset` is where these tokens' text starts in the choice; a
        token without log-probabilities (a prompt's first) gets nulls; `as_ids`: tokens named
        "token_id:N" (`return_tokens_as_token_ids`)."""
        result = CompletionLogProbs()
        for token_id, candidates in zip(token_ids, logprobs, strict=True):
            text = self.token_text(token_id)
            result.tokens.append(shown_token(token_id, text, as_ids))
            result.text_offset.append(offset)
            offset += len(text)
            if candidates is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen = candidates.get(token_id)
            result.token_logprobs.append(finite(None if chosen is None else chosen.logprob))
            best = top_k(candidates, k)
            result.top_logprobs.append(
                {shown_token(t, self.token_text(t), as_ids): finite(lp) for t, lp in best}
            )
        return result


def _joined(head: CompletionLogProbs | None, tail: CompletionLogProbs) -> CompletionLogProbs:
    if head is None:
        return tail
    return CompletionLogProbs(
        text_offset=head.text_offset + tail.text_offset,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        tokens=head.tokens + tail.tokens,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
    )


class _ChunkRenderer(ChunkRenderer[CompletionResponse]):
    """Streamed chunks of one request, keeping each choice's text offset for its log-probs;
    with echo, each choice's first chunk starts with its prompt."""

    chunk_type = CompletionResponse

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        echo: _Echo | None,
    ) -> None:
        super().__init__(request.model or serving.model_name, request_id, prompts, request)
        self.serving = serving
        self.k = request.logprobs
        self.as_ids = request.return_tokens_as_token_ids
        self.echo = echo
        self.offsets: dict[int, int] = {}  # choice index -> its text so far

    def render(self, deltas: list[Delta]) -> list[str]:
        chunks = []
        for delta in deltas:
            text, logprobs = "", None
            if delta.index not in self.offsets:
                if self.echo is not None:
                    text, logprobs = self.serving.echoed(
                        self.echo, delta.index, delta.prompt_logprobs, self.k, self.as_ids
                    )
                self.offsets[delta.index] = len(text)
            if self.k is not None and delta.logprobs is not None:
                offset = self.offsets[delta.index]
                tail = self.serving.logprobs(
                    delta.token_ids, delta.logprobs, self.k, offset, self.as_ids
                )
                logprobs = _joined(logprobs, tail)
            self.offsets[delta.index] += len(delta.text)
            choice = CompletionChoice(
                index=delta.index,
                text=text + delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
            )
            chunks.append(self.choice_chunk(choice, delta.index, len(delta.token_ids)))
        return chunks


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
