"""KV-cache groups: which layers share a block table and which cache tensor each uses."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention import AttentionSpec
from attnserve.attention.kv_cache_groups import KVCacheGroup, kv_cache_groups, num_cache_tensors


def _specs(windows: list[int | None], head_size: int = 16) -> list[AttentionSpec]:
    return [AttentionSpec(4, 2, head_size, torch.float32, sliding_window=w) for w in windows]


def test_a_model_without_windows_is_one_group_of_every_layer() -> None:
    groups = kv_cache_groups(_specs([None] * 4))
    assert groups == [KVCacheGroup(None, (0, 1, 2, 3))]
    assert num_cache_tensors(groups) == 4


def test_alternating_layers_make_two_groups_global_first() -> None:
    """Gemma 2: window and global layers alternate; two groups of two share two tensors."""
    groups = kv_cache_groups(_specs([8, None, 8, None]))
    assert groups == [KVCacheGroup(None, (1, 3)), KVCacheGroup(8, (0, 2))]
    assert num_cache_tensors(groups) == 2


def test_the_rarest_kind_sets_the_group_size() -> None:
    """Gemma 3's pattern (five local layers per global one), with two global layers: groups of
    two layers, the last window group shorter."""
    windows = [8] * 5 + [None] + [8] * 2 + [None]
    groups = kv_cache_groups(_specs(windows))
    assert groups == [
        KVCacheGroup(None, (5, 8)),
        KVCacheGroup(8, (0, 1)),
        KVCacheGroup(8, (2, 3)),
        KVCacheGroup(8, (4, 6)),
        KVCacheGroup(8, (7,)),
    ]
    assert num_cache_tensors(groups) == 2
    placed = sorted(layer for group in groups for layer in group.layers)
    assert placed == list(range(len(windows)))


def test_a_model_of_one_window_frees_behind_it_in_one_group() -> None:
    assert kv_cache_groups(_specs([8, 8, 8])) == [KVCacheGroup(8, (0, 1, 2))]


@pytest.mark.parametrize(
    "specs",
    [_specs([8, None, 8, None]), _specs([8]) + _specs([None], head_size=32)],
    ids=["hybrid-off", "cache-shapes-differ"],
)
def test_one_group_keeping_every_block_where_groups_cannot_share(
    specs: list[AttentionSpec],
) -> None:
    hybrid = len({s.head_size for s in specs}) > 1
    groups = kv_cache_groups(specs, hybrid=hybrid)
    assert groups == [KVCacheGroup(None, tuple(range(len(specs))))]


def test_a_bad_group_index_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv_cache_group must be an int >= 0"):
        AttentionSpec(4, 2, 16, torch.float32, kv_cache_group=-1)
