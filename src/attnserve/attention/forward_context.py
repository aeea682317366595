"""The per-step forward context: the attention metadata every `Attention` layer reads.

The model runner makes one metadata builder per distinct `AttentionSpec` of the model
(`metadata_builders`), builds the metadata once per step from the step's layout
(`build_metadata`; a graph step: `worker.graphs.build_graph_metadata`) and sets it here
around the model's forward, so models pass only hidden states, never backend inputs; each layer
takes the metadata of its own spec. The conformance harness builds through the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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
