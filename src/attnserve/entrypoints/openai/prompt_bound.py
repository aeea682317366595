"""`PromptBound`: the most prompt characters one token can stand for, read once from the
tokenizer, so that a text prompt too long for the context however it is tokenized is refused
before it is tokenized (`cannot_fit`).

The bound holds only for a tokenizer that never drops text and never folds a run of it into one
token longer than its longest vocabulary entry: a BPE model that has a token for every byte (a
byte-level alphabet, or byte fallback), no normalizer that can shorten the text, no pre-tokenizer
that removes any of it, no added token that swallows the whitespace around it. Each token then
stands for at most as many characters of the prompt as its own string has (byte-level: one per
byte; metaspace: one per character), so a prompt of C characters has at least C / longest
tokens. Such a tokenizer drops a byte its vocabulary lacks (SmolLM2's lacks a few control
characters'): an ASCII character of such a byte is dropped whole, so a prompt with one is not
judged early; a longer character keeps a byte unless a continuation byte is missing (then no
prompt past ASCII is judged early). For any other tokenizer `prompt_bound` gives None, and
prompts are judged only once tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


@dataclass(frozen=True)
class PromptBound:
    chars_per_token: int  # the longest vocabulary entry, in characters
    dropped_ascii: str = ""  # ASCII characters the tokenizer drops (no token for their byte)
    drops_non_ascii: bool = False  # a UTF-8 continuation byte has no token

    def cannot_fit(self, text: str, max_tokens: int) -> bool:
        """Whether `text` has more than `max_tokens` tokens, whatever they are (O(1) for text
        under the bound; a search for each dropped character otherwise)."""
        if len(text) <= max_tokens * self.chars_per_token:
            return False
        if self.drops_non_ascii and not text.isascii():
            return False
        return not any(c in text for c in self.dropped_ascii)


def prompt_bound(tokenizer: Any) -> PromptBound | None:
    """The tokenizer's bound, or None where it has none (see the module's docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    if not _keeps_text(_spec(backend.normalizer), _spec(backend.pre_tokenizer)):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    byte_tokens = _byte_tokens(backend)
    if byte_tokens is None:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    missing = [byte for byte, token in enumerate(byte_tokens) if token not in vocab]
    dropped_ascii = "".join(chr(byte) for byte in missing if byte < 0x80)
    drops_non_ascii = any(0x80 <= byte < 0xC0 for byte in missing)
    return PromptBound(max(map(len, vocab)), dropped_ascii, drops_non_ascii)


def _spec(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's JSON description (None for none)."""
    if component is None:
        return None
    spec: dict[str, Any] = json.loads(component.__getstate__())
    return spec


def _parts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A Sequence's members, or the component itself."""
    if spec.get("type") != "Sequence":
        return [spec]
    members = spec.get("normalizers") or spec.get("pretokenizers") or []
    return [part for member in members for part in _parts(member)]


def _keeps_text(normalizer: dict[str, Any] | None, pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether the normalizer never shortens the text and the pre-tokenizer removes none."""
    for part in _parts(normalizer) if normalizer else []:
        if part.get("type") == "Prepend":
            continue
        pattern = part.get("pattern") or {}
        if part.get("type") != "Replace" or "String" not in pattern:
            return False
        if len(part.get("content", "")) < len(pattern["String"]):
            return False
    for part in _parts(pre_tokenizer) if pre_tokenizer else []:
        if part.get("type") not in _PRE_TOKENIZERS:
            return False
        if str(part.get("behavior", "")).lower() == "removed":
            return False
    return True


def _byte_tokens(backend: Any) -> list[str] | None:
    """Each byte's token: byte fallback's `<0xXX>`, or the byte-level alphabet's character;
    None when the model has neither (it can drop characters it has no token for)."""
    if backend.model.byte_fallback:
        return [f"<0x{byte:02X}>" for byte in range(256)]
    pre_tokenizer = _spec(backend.pre_tokenizer)
    parts = _parts(pre_tokenizer) if pre_tokenizer else []
    if not any(part.get("type") == "ByteLevel" for part in parts):
        return None
    return byte_level_alphabet()


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet, by byte: printable bytes stand for themselves, the others
    for the characters from U+0100 on, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return [chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)]
