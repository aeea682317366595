"""Prompt dicts as vLLM's `vllm.inputs` takes them: `TextPrompt` (`{"prompt": "..."}`) and
`TokensPrompt` (`{"prompt_token_ids": [...]}`), beside plain strings and token id lists."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, taken as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
