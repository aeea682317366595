"""Incremental detokenization for byte-level BPE: text grows only by whole characters.

Each sequence keeps two offsets into its tokens: text is decoded from `prefix_offset` and only what
lies past `read_offset` is new. A piece that ends in an incomplete UTF-8 character (decoded as
U+FFFD) is held back until the next token completes it, so what is streamed concatenates exactly
to the final text.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens decoded before the new ones, so that a tokenizer's leading-space rules see their context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Given all tokens so far, append and return the newly complete text."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta
