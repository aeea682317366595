"""The per-step forward context: the attention metadata every `Attention` layer reads.

The model runner builds the metadata once per step, one object per distinct `AttentionSpec` of
the model, and sets them here around the model's forward, so models pass only hidden states,
never backend inputs; each layer takes the metadata of its own spec.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from attnserve.attention.backends.abstract import AttentionMetadata, AttentionSpec

StepMetadata = Mapping[AttentionSpec, AttentionMetadata]

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
