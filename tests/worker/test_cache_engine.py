"""CacheEngine: shapes from the backend, sizing from a budget, swap and copy through the backend."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention import AttentionSpec, get_attn_backend
from attnserve.worker.cache_engine import CacheEngine, num_blocks_for_budget


def _engine(num_swap_blocks: int = 0) -> CacheEngine:
    backend = get_attn_backend(AttentionSpec(2, 2, 16, torch.float32, block_size=4))
    return CacheEngine(
        backend, 2, 2, 16, 4, 6, torch.float32, "cpu", num_swap_blocks=num_swap_blocks
    )


def test_caches_follow_the_backend_shape_and_budget() -> None:
    engine = _engine()
    backend = engine.backend
    assert [tuple(c.shape) for c in engine.kv_caches] == [
        backend.get_kv_cache_shape(6, 4, 2, 16)
    ] * 2
    per_block = CacheEngine.bytes_per_block(backend, 2, 2, 16, 4, torch.float32)
    assert per_block == 2 * 2 * 4 * 2 * 16 * 4  # layers * (K,V) * slots * heads * dim * bytes
    assert num_blocks_for_budget(per_block * 10 + 5, per_block) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(per_block - 1, per_block)


def test_swap_roundtrip_and_copy_preserve_block_contents() -> None:
    engine = _engine(num_swap_blocks=3)
    for cache in engine.kv_caches:
        cache.copy_(torch.randn(cache.shape))
    original = [c.clone() for c in engine.kv_caches]
    engine.swap_out(torch.tensor([[1, 0], [4, 2]]))
    for cache in engine.kv_caches:
        cache.zero_()
    engine.swap_in(torch.tensor([[0, 3], [2, 5]]))
    engine.copy(torch.tensor([[3, 0]]))
    dim = engine.backend.get_kv_cache_block_dim()
    for before, after in zip(original, engine.kv_caches, strict=True):
        for src, dst in [(1, 3), (4, 5), (1, 0)]:
            assert torch.equal(before.select(dim, src), after.select(dim, dst))
