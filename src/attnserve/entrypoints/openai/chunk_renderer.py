"""`ChunkRenderer`, the streamed chunks of one API call as JSON text (each endpoint's subclass
renders its choices), and `usage`, the token counts of a response."""

from __future__ import annotations

from typing import Generic, TypeVar

from pydantic import BaseModel

from attnserve.entrypoints.openai.deltas import Delta
from attnserve.entrypoints.openai.protocol import SamplingRequest, UsageInfo

ChunkT = TypeVar("ChunkT", bound=BaseModel)


class ChunkRenderer(Generic[ChunkT]):
    """The streamed chunks of one API call, as JSON: each endpoint's `render` turns a batch of
    deltas into chunks of its `chunk_type`; the closing usage chunk (if the request asks for it)
    is the same for both, and so is, with `continuous_usage_stats`, each chunk's usage so far
    (of its choice: its prompt's tokens and the tokens it has generated). The fields every chunk
    of the call shares (`id`, `object`, `created`, `model`) are written once; each chunk then
    encodes only its choices (the JSON `chunk_type(...).model_dump_json(exclude_none=True)`
    would give, at a third of the cost), each with `"logprobs": null` and `"finish_reason": null`
    where it has none, as OpenAI sends them (`NULL_CHOICE_FIELDS`)."""

    chunk_type: type[ChunkT]

    def __init__(
        self, model_name: str, request_id: str, prompts: list[list[int]], request: SamplingRequest
    ) -> None:
        self.prompts = prompts
        self.n = request.n
        self.include_usage = request.include_usage
        self.continuous_usage = request.continuous_usage
        self.generated: dict[int, int] = {}  # choice index -> tokens so far
        shared = self.chunk_type(id=request_id, model=model_name, choices=[])
        self._head = shared.model_dump_json(exclude_none=True)[: -len("]}")]  # "...choices":[

    def chunk(self, choices: list[BaseModel], usage_info: UsageInfo | None = None) -> str:
        """One chunk's JSON."""
        parts = [self._head, ",".join(_choice_json(c) for c in choices)]
        if usage_info is not None:
            parts.append(f'],"usage":{usage_info.model_dump_json()}}}')
        else:
            parts.append("]}")
        return "".join(parts)

    def count_tokens(self, index: int, new_tokens: int) -> None:
        """`new_tokens` more generated for choice `index` (a held-back delta's too)."""
        self.generated[index] = self.generated.get(index, 0) + new_tokens

    def choice_chunk(self, choice: BaseModel, index: int, new_tokens: int) -> str:
        """A chunk of one choice that brings `new_tokens` more tokens."""
        self.count_tokens(index, new_tokens)
        if not self.continuous_usage:
            return self.chunk([choice])
        return self.chunk([choice], usage([self.prompts[index // self.n]], self.generated[index]))

    def usage_chunk(self, tokens: int) -> str | None:
        return self.chunk([], usage(self.prompts, tokens)) if self.include_usage else None

    def render(self, deltas: list[Delta]) -> list[str]:
        raise NotImplementedError


NULL_CHOICE_FIELDS = ("logprobs", "finish_reason")  # a streamed choice's, written even when null


def _choice_json(choice: BaseModel) -> str:
    """A streamed choice's JSON: its fields that are set, and `NULL_CHOICE_FIELDS` always."""
    text = choice.model_dump_json(exclude_none=True)
    nulls = "".join(f',"{name}":null' for name in NULL_CHOICE_FIELDS if _is_null(choice, name))
    return f"{text[:-1]}{nulls}}}" if nulls else text


def _is_null(choice: BaseModel, name: str) -> bool:
    return name in type(choice).model_fields and getattr(choice, name) is None


def usage(prompts: list[list[int]], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
