"""The tokenizer of a `ModelConfig` (an HF tokenizer directory or a GGUF file's vocabulary),
with its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from attnserve.model.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from a GGUF file's metadata (no network)."""
    from transformers import AutoTokenizer

    path = Path(path)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    return tokenizer


def load_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; ValueError when it has none (dummy weights: prompts are ids) or
    when it has more tokens than the model's vocabulary (a tokenizer given for a dummy preset
    may be any whose vocabulary fits)."""
    from transformers import AutoTokenizer

    if config.tokenizer is None:
        raise ValueError(
            f"model {config.model!r} has no tokenizer (dummy weights): pass prompts as token ids "
            "or give a tokenizer path"
        )
    if config.tokenizer.endswith(".gguf"):
        tokenizer = load_gguf_tokenizer(config.tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(
            config.tokenizer, local_files_only=True, trust_remote_code=config.trust_remote_code
        )
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"tokenizer {config.tokenizer!r} has {len(tokenizer)} tokens, more than the "
            f"{config.vocab_size} of model {config.model!r}'s vocabulary"
        )
    return tokenizer
