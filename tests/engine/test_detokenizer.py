"""Incremental detokenizing against whole decodes: the embedded model's tokenizer (its
`DecodeStream` path) and the same tokenizer without its `tokenizers` backend (the window path)
give, token by token or in bulk, exactly `tokenizer.decode` of the output — multi-byte
characters split over tokens, special tokens skipped or kept."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import pytest
from transformers import PreTrainedTokenizerBase

from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.model.default_model import embedded_gguf_path
from attnserve.model.tokenizer import load_gguf_tokenizer

TEXTS = [
    "Grüße aus Köln 🌍🚀 — 東京タワー, naïve café! ∑ x² ≤ 3",
    "<|im_start|>assistant\nLe 日本語 🙂<|im_end|> fin",
    "plain ascii, numbers 12345 and  double  spaces",
]


@functools.cache
def _tokenizer() -> PreTrainedTokenizerBase:
    return load_gguf_tokenizer(embedded_gguf_path())


class _WithoutBackend:
    """The tokenizer as one without a `tokenizers` backend sees it: decode only."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.decode = tokenizer.decode


def _streamed(tokenizer: Any, prompt: list[int], ids: list[int], skip: bool, chunk: int) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = []
    for start in range(0, len(ids), chunk):
        final = start + chunk >= len(ids)
        pieces.append(detokenizer.step(ids[start : start + chunk], final=final))
    assert "".join(pieces) == detokenizer.text
    return detokenizer.text


@pytest.mark.parametrize("backend", [True, False], ids=["decode-stream", "window"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("chunk", [1, 3, 1000], ids=["one-by-one", "threes", "bulk"])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_streamed_text_equals_a_whole_decode(
    backend: bool, skip: bool, chunk: int, text: str
) -> None:
    tokenizer = _tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    used = tokenizer if backend else _WithoutBackend(tokenizer)
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert _streamed(used, prompt, ids, skip, chunk) == expected


@pytest.mark.parametrize("backend", [True, False], ids=["decode-stream", "window"])
def test_no_piece_ends_inside_a_character(backend: bool) -> None:
    tokenizer = _tokenizer()
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    used = tokenizer if backend else _WithoutBackend(tokenizer)
    detokenizer = IncrementalDetokenizer(used, [], skip_special_tokens=True)
    pieces = [detokenizer.step([i]) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == TEXTS[0]


@pytest.mark.parametrize("backend", [True, False], ids=["decode-stream", "window"])
def test_an_unfinished_character_at_the_end_is_replaced(backend: bool) -> None:
    tokenizer = _tokenizer()
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) > 1  # a character over several byte tokens
    used = tokenizer if backend else _WithoutBackend(tokenizer)
    detokenizer = IncrementalDetokenizer(used, [], skip_special_tokens=True)
    assert detokenizer.step(ids[:1]) == ""
    assert detokenizer.step([], final=True) == tokenizer.decode(ids[:1])


class _SpacedSpecials:
    """A tokenizer without a `tokenizers` backend that, like HF's slow tokenizers, puts spaces
    around special tokens only with `spaces_between_special_tokens`."""

    PIECES: ClassVar[dict[int, str]] = {1: "<s>", 2: "a", 3: "b"}

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        pieces = [self.PIECES[t] for t in token_ids]
        if not spaces_between_special_tokens:
            return "".join(pieces)
        return "".join(f" {p} " if p.startswith("<") else p for p in pieces)


@pytest.mark.parametrize(("spaces", "text"), [(True, "a <s> b"), (False, "a<s>b")])
def test_spaces_between_special_tokens_reach_the_window_decodes(spaces: bool, text: str) -> None:
    detokenizer = IncrementalDetokenizer(
        _SpacedSpecials(), [], skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    detokenizer.step([2, 1, 3], final=True)
    assert detokenizer.text == text
