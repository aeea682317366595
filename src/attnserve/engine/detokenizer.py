"""Incremental detokenization: each sequence's text grows by whole characters as its tokens come.

With a tokenizer backed by the `tokenizers` library (every fast HF tokenizer, and the ones built
from GGUF files) each new token is one call into its `DecodeStream` (Rust: about a microsecond,
against two whole-window decodes through transformers before). The stream is first fed the last
few prompt tokens, so a tokenizer's leading-space rules see their context, and it holds back a
piece that ends inside a UTF-8 character until the next token completes it. Other tokenizers
decode a short window twice per step: text from `prefix_offset`, of which only what lies past
`read_offset` is new, held back while it ends in U+FFFD. Either way what is streamed
concatenates exactly to the final text; a sequence that ends inside a character gets U+FFFD for
it, as a whole decode would. `spaces_between_special_tokens` (vLLM's) is passed to the decodes
of the window path: tokenizers without a `tokenizers` backend put spaces around special tokens
by it; a `DecodeStream` has no such option (as in vLLM, where only slow tokenizers heed it).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded before the new ones, so that a tokenizer's leading-space rules see their
# context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.text = ""
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend: Tokenizer | None = backend if isinstance(backend, Tokenizer) else None
        self._pending: list[int] = []  # tokens the stream holds inside a character
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in context:
                self._stream.step(self._backend, token_id)
        self._window = list(context)  # the other tokenizers: context, then the output so far
        self._prefix_offset, self._read_offset = 0, len(context)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Take the next tokens; append and return the newly complete text (with `final`, also
        what is left inside an unfinished character)."""
        backend = self._backend
        delta = (
            self._stream_step(backend, new_token_ids, final)
            if backend is not None
            else self._window_step(new_token_ids, final)
        )
        self.text += delta
        return delta

    def _stream_step(self, backend: Tokenizer, new_token_ids: list[int], final: bool) -> str:
        pieces = []
        for token_id in new_token_ids:
            piece = self._stream.step(backend, token_id)
            if piece is None:
                self._pending.append(token_id)
            else:
                pieces.append(piece)
                self._pending.clear()
        if final and self._pending:
            pieces.append(self._decode(self._pending))
            self._pending = []
        return "".join(pieces)

    def _window_step(self, new_token_ids: list[int], final: bool) -> str:
        window = self._window
        window += new_token_ids
        prefix = self._decode(window[self._prefix_offset : self._read_offset])
        full = self._decode(window[self._prefix_offset :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(window)
        return full[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        return str(text)
