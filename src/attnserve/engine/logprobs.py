"""Log-probabilities as the user sees them (vLLM's shape): the core's `TokenLogprobs` (token id
-> value: the top k in rank order, then the drawn token when it is not among them) become a dict
of `Logprob`s, the drawn token's first, each with its rank and its text.

The texts of a tokenizer's tokens are decoded once and kept (one table per tokenizer).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from transformers import PreTrainedTokenizerBase

from attnserve.outputs import Logprob, PromptLogprobs, SampleLogprobs
from attnserve.step_types import TokenLogprobs

_TEXTS: WeakKeyDictionary[PreTrainedTokenizerBase, dict[int, str]] = WeakKeyDictionary()


class LogprobsBuilder:
    """Builds `Logprob` dicts, with token texts from `tokenizer` (None: no texts)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.texts = _TEXTS.setdefault(tokenizer, {}) if tokenizer is not None else {}

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def entry(self, values: TokenLogprobs, chosen: int, k: int) -> dict[int, Logprob]:
        """One position's entries: the `chosen` (drawn or prompt) token's, then the top `k`."""
        top = list(values)[:k]
        rank = top.index(chosen) + 1 if chosen in top else None
        entry = {chosen: Logprob(values[chosen], rank, self.text(chosen))}
        for position, token in enumerate(top, start=1):
            if token != chosen:
                entry[token] = Logprob(values[token], position, self.text(token))
        return entry

    def sample(self, rows: list[TokenLogprobs], token_ids: list[int], k: int) -> SampleLogprobs:
        """Per output token (`token_ids`, one per row)."""
        return [self.entry(row, token, k) for row, token in zip(rows, token_ids, strict=True)]

    def prompt(
        self, rows: list[TokenLogprobs], prompt_token_ids: list[int], k: int
    ) -> PromptLogprobs:
        """Per prompt token: None for the first, then each one's entries (row i scores token
        i + 1)."""
        return [None, *self.sample(rows, prompt_token_ids[1 : len(rows) + 1], k)]
