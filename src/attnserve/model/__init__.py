"""attnserve's model layer: model configs, the Llama-family model, weight loading, tokenizers."""

from attnserve.model.config import ModelConfig
from attnserve.model.loader import load_model
from attnserve.model.tokenizer import load_tokenizer

__all__ = ["ModelConfig", "load_model", "load_tokenizer"]
