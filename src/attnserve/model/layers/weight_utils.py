"""Checkpoint weights as the parallel layers' weight loaders see them.

A loader always receives the FULL checkpoint weight and copies only its rank's shard. That
weight is a tensor (GGUF, dummy, a single-rank safetensors load) or a lazy safetensors slice
(`safe_open(...).get_slice`), so a rank reads only the rows or columns it keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn


class LazySlice(Protocol):
    """A tensor still on disk (safetensors' `PySafeSlice`): its shape, and slicing reads it."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


LoadedWeight = torch.Tensor | LazySlice
WeightLoader = Callable[..., None]


def weight_shape(weight: LoadedWeight) -> tuple[int, ...]:
    if isinstance(weight, torch.Tensor):
        return tuple(weight.shape)
    return tuple(weight.get_shape())


def narrow_weight(weight: LoadedWeight, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of `weight`, read only there."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, size)
    index = (slice(None),) * dim + (slice(start, start + size),)
    return weight[index]


def full_weight(weight: LoadedWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight[:]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, weight: LoadedWeight, name: str = "") -> None:
    """A replicated parameter takes the whole weight, without a copy when it can."""
    loaded = full_weight(weight)
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    if loaded.dtype == param.dtype and loaded.device == param.device:
        param.data = loaded  # no copy (a memory-mapped checkpoint stays mapped)
    else:
        param.data.copy_(loaded)


def set_weight_attrs(
    param: nn.Parameter, loader: WeightLoader, full_shape: tuple[int, ...]
) -> None:
    """Mark `param` as sharded: its loader, and the shape of the full (all-rank) weight."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.full_shape = full_shape  # type: ignore[attr-defined]


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The shape of the full weight that `param` is this rank's shard of."""
    shape: tuple[int, ...] = getattr(param, "full_shape", tuple(param.shape))
    return shape


def load_weight(
    param: nn.Parameter, weight: LoadedWeight, name: str, shard_id: str | None = None
) -> None:
    """Fill `param` from a full checkpoint weight (one named part of it for merged layers)."""
    loader: WeightLoader | None = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, weight, shard_id)
    elif shard_id is not None:
        raise ValueError(f"{name}: parameter has no shards, got shard {shard_id!r}")
    else:
        default_weight_loader(param, weight, name)
