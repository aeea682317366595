"""Quantized weights (vLLM's `quantization`): the methods by name and what each layer runs.

`base` holds the layer contract; `weight_utils` the checkpoint weights as the layers' weight
loaders see them (and the row stores a method sets on its parameters); `gguf` keeps a GGUF file's
Q4_0/Q4_1/Q8_0 tensors packed (CPU); `fp8` runs FP8 E4M3 weights with dynamic per-token
activation scales through `torch._scaled_mm`.
"""

from attnserve.model.quantization.base import (
    EmbeddingMethod,
    LinearMethod,
    QuantizationConfig,
    active_quantization,
    embedding_method_for,
    linear_method_for,
    process_weights_after_loading,
)

__all__ = [
    "EmbeddingMethod",
    "LinearMethod",
    "QuantizationConfig",
    "active_quantization",
    "embedding_method_for",
    "linear_method_for",
    "process_weights_after_loading",
]
