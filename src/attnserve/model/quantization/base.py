"""What a quantization is to the layers: a `QuantizationConfig` hands each linear layer (and
embedding) the method that creates, loads and multiplies its weight (vLLM's names).

The loader builds the model under `active_quantization(config)`; each layer asks for its method
while it is built (`linear_method_for`, `embedding_method_for`), so the models themselves never
name a quantization. After the weights are loaded, `process_weights_after_loading` lets every
method turn what it collected into the form it multiplies with.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attnserve.model.quantization.fp8_format import Fp8Activation


def layer_weight(layer: nn.Module) -> nn.Parameter:
    """The `weight` parameter a layer's method registered."""
    weight = layer.weight
    if not isinstance(weight, nn.Parameter):
        raise TypeError(f"{type(layer).__name__}.weight is not a parameter")
    return weight


class LinearMethod:
    """How a linear layer holds its weight [out, in] and computes `x W^T + bias`.
    `takes_fp8_input`: it multiplies inputs quantized per row (`apply_fp8`), so the op before
    it may quantize its output in its own kernel (`linear.fuse_input_quantization`)."""

    takes_fp8_input: ClassVar[bool] = False

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        """Register the layer's `weight` (and whatever else the method keeps)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once all of the layer's weights are loaded."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_fp8(
        self, layer: nn.Module, x: Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`apply` of an input already quantized per row (only where `takes_fp8_input`)."""
        raise NotImplementedError(f"{type(self).__name__} takes no FP8 input")

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight as the matmul sees it, in float (to export the model, e.g. to HF)."""
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model's dtype, through `F.linear`."""

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        weight = torch.empty(out_features, in_features)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer_weight(layer), bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer_weight(layer)


class EmbeddingMethod:
    """How a vocabulary embedding holds its table [rows, dim]: lookups and, for a tied or
    separate LM head, logits."""

    def create_weights(self, layer: nn.Module, rows: int, dim: int) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once the table is loaded."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    def create_weights(self, layer: nn.Module, rows: int, dim: int) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, dim), requires_grad=False)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer_weight(layer))

    def logits(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, layer_weight(layer))

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer_weight(layer)


class QuantizationConfig:
    """One quantization of one model: the method of each layer. `name` is its
    `quantization` value (vLLM's)."""

    name = "none"

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return UnquantizedLinearMethod()

    def embedding_method(self, layer: nn.Module) -> EmbeddingMethod:
        return UnquantizedEmbeddingMethod()


_ACTIVE: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar(
    "attnserve_quantization", default=None
)


@contextmanager
def active_quantization(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers built inside take their methods from `config` (None: unquantized)."""
    token = _ACTIVE.set(config)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _active() -> QuantizationConfig:
    return _ACTIVE.get() or QuantizationConfig()


def linear_method_for(layer: nn.Module) -> LinearMethod:
    return _active().linear_method(layer)


def embedding_method_for(layer: nn.Module) -> EmbeddingMethod:
    return _active().embedding_method(layer)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's method finish its weights (see the module docstring)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethod | EmbeddingMethod):
            method.process_weights_after_loading(module)
