"""Streamed chunks are written once per call's shared fields and once per choice: the JSON
must decode to what pydantic's own encoding of the whole chunk model gives (the reference), with
each choice's `logprobs` and `finish_reason` null where it has none (as OpenAI sends them), for
both endpoints' chunk types, with and without usage, with text that needs escaping."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from attnserve.entrypoints.openai.chunk_renderer import NULL_CHOICE_FIELDS, ChunkRenderer
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)

TEXTS = ["plain", 'quote " and \\ backslash', "line\nbreak\ttab \u0001", "héllo 世界 🙂", ""]


def _renderer(chunk_type: type[BaseModel], **stream_options: Any) -> ChunkRenderer[Any]:
    request = CompletionRequest(
        prompt=[1, 2, 3], stream=True, stream_options=stream_options or None, n=2
    )
    kind = type("Renderer", (ChunkRenderer,), {"chunk_type": chunk_type})
    return kind("model/é", "cmpl-123", [[1, 2, 3]], request)  # type: ignore[no-any-return]


def _reference(
    renderer: ChunkRenderer[Any], choices: list[Any], usage: Any = None
) -> dict[str, Any]:
    created = json.loads(renderer.chunk([]))["created"]
    model = renderer.chunk_type(
        id="cmpl-123", model="model/é", choices=choices, usage=usage, created=created
    )
    reference: dict[str, Any] = json.loads(model.model_dump_json(exclude_none=True))
    for choice in reference["choices"]:
        for name in NULL_CHOICE_FIELDS:
            choice.setdefault(name, None)
    return reference


@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunks_match_the_models_encoding(text: str) -> None:
    renderer = _renderer(CompletionResponse)
    choices = [
        CompletionChoice(index=0, text=text),
        CompletionChoice(
            index=1,
            text=text,
            logprobs=CompletionLogProbs(
                text_offset=[0], token_logprobs=[-0.5], tokens=[text], top_logprobs=[{text: -0.5}]
            ),
            finish_reason="stop",
        ),
    ]
    for choice in choices:
        assert json.loads(renderer.chunk([choice])) == _reference(renderer, [choice])
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert json.loads(renderer.chunk(choices, usage)) == _reference(renderer, choices, usage)
    assert json.loads(renderer.chunk([], usage)) == _reference(renderer, [], usage)


@pytest.mark.parametrize("text", TEXTS)
def test_chat_chunks_match_the_models_encoding(text: str) -> None:
    renderer = _renderer(ChatCompletionChunk)
    role = ChatStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    content = ChatStreamChoice(index=1, delta=DeltaMessage(content=text), finish_reason="length")
    for choice in (role, content):
        assert json.loads(renderer.chunk([choice])) == _reference(renderer, [choice])
    assert json.loads(renderer.chunk([content]))["object"] == "chat.completion.chunk"


def test_usage_chunks_count_each_choices_tokens() -> None:
    renderer = _renderer(CompletionResponse, include_usage=True, continuous_usage_stats=True)
    first = json.loads(renderer.choice_chunk(CompletionChoice(index=1, text="a"), 1, 2))
    second = json.loads(renderer.choice_chunk(CompletionChoice(index=1, text="b"), 1, 3))
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert second["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    closing = renderer.usage_chunk(9)
    assert closing is not None and json.loads(closing)["choices"] == []
    assert _renderer(CompletionResponse).usage_chunk(9) is None
