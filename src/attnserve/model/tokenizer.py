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
    """The model's tokenizer; ValueError when it has none (dummy weights: prompts are ids)."""
    from transformers import AutoTokenizer

    if config.tokenizer is None:
        raise ValueError(
            f"model {config.model!r} has no tokenizer (dummy weights): pass prompts as token ids "
            "or give a tokenizer path"
        )
    if config.tokenizer.endswith(".gguf"):
        return load_gguf_tokenizer(config.tokenizer)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        config.tokenizer, local_files_only=True
    )
    return tokenizer
