"""The model registry: HF `architectures[0]` -> the attnserve class that implements it, by name.

The registry names the classes without importing them (the model config checks architectures
here, and the models import the model config); `model.loader.get_model_cls` imports the class.
"""

from __future__ import annotations

_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("attnserve.model.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("attnserve.model.models.gemma", "Gemma3ForCausalLM"),
    "LlamaForCausalLM": ("attnserve.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("attnserve.model.models.llama", "MistralForCausalLM"),
    "MixtralForCausalLM": ("attnserve.model.models.moe", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("attnserve.model.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("attnserve.model.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("attnserve.model.models.moe", "Qwen3MoeForCausalLM"),
}
# multimodal architectures served as their text model (the vision tower is not loaded)
TEXT_MODELS: dict[str, str] = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(architecture: str) -> None:
    """ValueError naming `architecture` when no registered model implements it."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{supported_architectures()}"
        )


def get_model_cls_name(architecture: str) -> tuple[str, str]:
    """(module, class name) of the model class for an HF architecture name."""
    check_architecture(architecture)
    return _MODELS[architecture]
