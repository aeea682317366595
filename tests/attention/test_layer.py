"""`Attention`: its spec comes from its arguments and the defaults it is built under, a backend
handed to it is checked against that spec, the model runner's helpers collect and bind, and a
split at attention takes every layer's call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attnserve import LLM
from attnserve.attention import (
    Attention,
    attention_layers,
    attention_specs,
    bind_attention_backend,
    build_metadata,
    build_step_layout,
    set_forward_context,
    splitting_at_attention,
)
from attnserve.attention.backends.torch_sdpa import TorchSDPABackend


def _layer(**kwargs: object) -> Attention:
    return Attention(8, 64, 0.125, 2, **kwargs)  # type: ignore[arg-type]


def test_spec_describes_the_layer() -> None:
    spec = _layer(alibi_slopes=[0.5] * 8, logits_soft_cap=30.0, block_size=32).spec
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (8, 2, 64)
    assert (spec.dtype, spec.device, spec.block_size) == (torch.float32, "cpu", 32)
    assert spec.use_alibi and spec.logits_soft_cap == 30.0 and spec.sliding_window is None


def test_a_backend_that_cannot_serve_the_layer_is_refused_with_the_reason() -> None:
    assert not TorchSDPABackend.supports(_layer(block_size=512).spec)
    with pytest.raises(ValueError, match=r"TORCH_SDPA cannot serve.*block size 512"):
        _layer(block_size=512, backend=TorchSDPABackend)


def test_a_layer_without_a_backend_says_so() -> None:
    layer = _layer()
    with pytest.raises(RuntimeError, match="no attention backend bound"):
        layer(torch.zeros(1, 512), torch.zeros(1, 128), torch.zeros(1, 128))


def test_specs_are_distinct_in_order_and_binding_reaches_every_layer() -> None:
    model = nn.ModuleList([_layer(), _layer(sliding_window=4), _layer()])
    specs = attention_specs(model)
    assert [s.sliding_window for s in specs] == [None, 4]
    bind_attention_backend(model, TorchSDPABackend)
    assert all(layer.backend is TorchSDPABackend for layer in model)  # type: ignore[union-attr]


def test_a_split_at_attention_takes_every_layers_call_in_order(tiny_llama_dir: Path) -> None:
    """What the piecewise graph runner relies on: under `splitting_at_attention` each attention
    layer hands its inputs to the split, in module order, and runs no operator (no cache write);
    a split that runs the operator itself gives the plain forward's output."""
    llm = LLM(str(tiny_llama_dir), device="cpu")
    runner = llm.llm_engine.executor.driver_runner
    layout = build_step_layout([[1]], [0], [5], runner.cache_config.block_size)
    metadata = build_metadata(runner.builders, layout)
    ids, positions = torch.tensor([3, 1, 4, 1, 5]), layout.token_pos
    with torch.inference_mode(), set_forward_context(metadata):
        before = [cache.clone() for cache in runner.cache_engine.kv_caches]
        seen: list[nn.Module] = []

        def zeros(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            seen.append(layer)
            return torch.zeros_like(q)

        with splitting_at_attention(runner.model, zeros):
            runner.model(ids, positions)
        assert seen == attention_layers(runner.model)
        after = runner.cache_engine.kv_caches
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        reference = runner.model(ids, positions)

        def operator(layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
            return layer.impl.forward(q, k, v, layer.kv_cache, metadata[layer.spec])

        with splitting_at_attention(runner.model, operator):
            split = runner.model(ids, positions)
    assert torch.equal(split, reference)
