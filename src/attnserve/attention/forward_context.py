"""The per-step forward context: the attention metadata every `Attention` layer reads.

The model runner builds the metadata once per step and sets it here around the model's forward,
so models pass only hidden states, never backend inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from attnserve.attention.backends.abstract import AttentionMetadata

_current_metadata: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata) -> Iterator[None]:
    """Make `attn_metadata` the metadata of every attention layer inside the block."""
    global _current_metadata
    previous, _current_metadata = _current_metadata, attn_metadata
    try:
        yield
    finally:
        _current_metadata = previous


def get_attn_metadata() -> AttentionMetadata:
    if _current_metadata is None:
        raise RuntimeError("attention layer called outside set_forward_context(...)")
    return _current_metadata
