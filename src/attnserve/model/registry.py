"""The model registry: HF `architectures[0]` -> the attnserve class that implements it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnserve.model.models.llama import LlamaForCausalLM

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "attnserve.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "attnserve.model.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "attnserve.model.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "attnserve.model.models.llama:Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    """ValueError naming `architecture` when no registered model implements it."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{supported_architectures()}"
        )


def get_model_cls(architecture: str) -> type[LlamaForCausalLM]:
    """The model class for an HF architecture name."""
    check_architecture(architecture)
    module_name, _, attr = _MODELS[architecture].partition(":")
    model_cls: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), attr)
    return model_cls
