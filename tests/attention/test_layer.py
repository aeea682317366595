"""`Attention`: its spec comes from its arguments and the defaults it is built under, a backend
handed to it is checked against that spec, and the model runner's helpers collect and bind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnserve.attention import Attention, attention_specs, bind_attention_backend
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
