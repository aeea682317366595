"""The per-step forward context: the attention metadata every `Attention` layer reads.

The model runner makes one metadata builder per distinct `AttentionSpec` of the model
(`metadata_builders`), builds the metadata once per step from the step's layout
(`build_metadata`, or `build_graph_metadata` for a padded CUDA-graph step) and sets it here
around the model's forward, so models pass only hidden states, never backend inputs; each layer
takes the metadata of its own spec. The conformance harness builds through the same functions.

A graph runner that captures a forward piecewise, around its attention calls, sets an
`AttentionSplit` here instead (`splitting_at_attention`): each attention layer then hands its
query, key and value to the split, which returns the layer's output, and runs no operator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from attnserve.attention.abstract import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
)
from attnserve.attention.layout import StepLayout

StepMetadata = Mapping[AttentionSpec, AttentionMetadata]
Builders = Mapping[AttentionSpec, AttentionMetadataBuilder[Any]]
# (the attention layer, its query, key, value) -> the layer's output
AttentionSplit = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def metadata_builders(
    backend: type[AttentionBackend], specs: Iterable[AttentionSpec], device: torch.device | str
) -> dict[AttentionSpec, AttentionMetadataBuilder[Any]]:
    """One builder of `backend` for each spec."""
    return {spec: backend.get_builder_cls()(spec, device) for spec in specs}


def build_metadata(builders: Builders, layout: StepLayout) -> StepMetadata:
    """Every spec's metadata for one step (from its KV-cache group's block table)."""
    return {
        spec: builder.build(layout.for_group(spec.kv_cache_group))
        for spec, builder in builders.items()
    }


def build_graph_metadata(builders: Builders, padded: StepLayout) -> StepMetadata:
    """Every spec's metadata for a decode step padded to a capture bucket, written into the
    builders' persistent buffers."""
    return {
        spec: builder.build_for_graph(padded.for_group(spec.kv_cache_group))
        for spec, builder in builders.items()
    }


_current: StepMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: StepMetadata) -> Iterator[None]:
    """Make `attn_metadata[spec]` the metadata of every attention layer of `spec` inside the
    block."""
    global _current
    previous, _current = _current, attn_metadata
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata(spec: AttentionSpec) -> AttentionMetadata:
    """This step's metadata for the layers of `spec`."""
    if _current is None:
        raise RuntimeError("attention layer called outside set_forward_context(...)")
    metadata = _current.get(spec)
    if metadata is None:
        raise RuntimeError(f"the forward context has no metadata for {spec}")
    return metadata


_split: AttentionSplit | None = None


@contextmanager
def splitting_at_attention(split: AttentionSplit) -> Iterator[None]:
    """Inside the block, every attention layer's call is `split(layer, query, key, value)`."""
    global _split
    previous, _split = _split, split
    try:
        yield
    finally:
        _split = previous


def attention_split() -> AttentionSplit | None:
    """The split set by `splitting_at_attention`, if any."""
    return _split
