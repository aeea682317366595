"""KV-cache groups: which attention layers share a block table, and which cache tensor each uses.

A model whose layers attend alike (every Llama) is one group: its layers read one block table
and each owns a cache tensor. A model that mixes sliding-window and global layers (Gemma 2,
Gemma 3) is split, as vLLM's hybrid KV-cache manager splits it, into groups of equally many
layers of one kind each (`kv_cache_groups`). Each group has its own block table, so the blocks a
window group's sequence no longer reads can be freed while the global layers keep theirs; and
the i-th layer of every group uses the i-th of `num_cache_tensors` cache tensors, so one block id
(held by one group at a time) costs a group's layers' worth of memory, not every layer's, and
all groups draw from one pool of blocks. Groups keep the global layers first, so group 0 keeps
every block while its sequence lives (a draft model's cache follows group 0's table).

`assign_kv_cache_groups` records each layer's group in its `AttentionSpec` (`kv_cache_group`):
layers of different groups then have different specs, and so their own metadata builder, which
reads its group's block table from the step's layout (`StepLayout.for_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attnserve.attention.abstract import AttentionSpec
from attnserve.attention.layer import attention_layers, bind_kv_caches


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (indices among the model's attention layers) that share one block table; with a
    `sliding_window`, a sequence's blocks behind its window are freed as it advances."""

    sliding_window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(specs: Sequence[AttentionSpec], hybrid: bool = True) -> list[KVCacheGroup]:
    """The groups of a model whose attention layers have `specs` (one per layer, in order): one
    group unless `hybrid` and the layers mix windows (with one cache shape); then the layers
    of each kind (global first) in runs of as many as the rarest kind has (the last run of a
    kind may be shorter). A model whose every layer has one window is one group with it."""
    shapes = {(s.num_kv_heads, s.head_size, s.dtype, s.kv_cache_dtype) for s in specs}
    kinds = list(dict.fromkeys(s.sliding_window for s in specs))
    if not hybrid or len(shapes) > 1 or len(kinds) == 1:
        return [KVCacheGroup(kinds[0] if hybrid and len(kinds) == 1 else None, _all(specs))]
    kinds.sort(key=lambda window: window is not None)
    members = {kind: [i for i, s in enumerate(specs) if s.sliding_window == kind] for kind in kinds}
    size = min(map(len, members.values()))
    return [
        KVCacheGroup(kind, tuple(layers[start : start + size]))
        for kind, layers in members.items()
        for start in range(0, len(layers), size)
    ]


def _all(specs: Sequence[AttentionSpec]) -> tuple[int, ...]:
    return tuple(range(len(specs)))


def num_cache_tensors(groups: Sequence[KVCacheGroup]) -> int:
    """How many cache tensors the groups' layers share: the largest group's size."""
    return max(len(group.layers) for group in groups)


def assign_kv_cache_groups(model: nn.Module, hybrid: bool = True) -> list[KVCacheGroup]:
    """Group `model`'s attention layers (`kv_cache_groups`) and record each layer's group in
    its spec; return the groups. Call before the backend is bound."""
    layers = attention_layers(model)
    groups = kv_cache_groups([layer.spec for layer in layers], hybrid)
    for index, group in enumerate(groups):
        for layer in group.layers:
            spec = layers[layer].spec
            layers[layer].spec = dataclasses.replace(spec, kv_cache_group=index)
    return groups


def bind_group_caches(
    model: nn.Module, groups: Sequence[KVCacheGroup], caches: Sequence[torch.Tensor]
) -> None:
    """Give each attention layer of `model` the cache tensor of its place in its group."""
    per_layer: dict[int, torch.Tensor] = {}
    for group in groups:
        per_layer.update((layer, caches[place]) for place, layer in enumerate(group.layers))
    bind_kv_caches(model, [per_layer[i] for i in range(len(per_layer))])
