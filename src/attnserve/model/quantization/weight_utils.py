"""Checkpoint weights as the parallel layers' weight loaders see them.

A loader always receives the FULL checkpoint weight and copies only its rank's shard. That
weight is a tensor (GGUF, dummy, a single-rank safetensors load) or a lazy slice (safetensors'
`safe_open(...).get_slice`, or a GGUF tensor kept quantized), so a rank reads only the rows or
columns it keeps. Loaders write a parameter's rows with `store_rows`: a quantized parameter
carries a `row_store` (set by its quantization method) that quantizes or keeps what it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn


class LazySlice(Protocol):
    """A weight not yet a plain tensor: still on disk (safetensors' `PySafeSlice`: slicing reads
    it) or packed (a GGUF tensor's blocks: slicing narrows them); its shape, and slices."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor | LazySlice: ...


LoadedWeight = torch.Tensor | LazySlice
WeightLoader = Callable[..., None]
RowStore = Callable[[int, LoadedWeight], None]  # (first row of the parameter, the rows)


def weight_shape(weight: LoadedWeight) -> tuple[int, ...]:
    if isinstance(weight, torch.Tensor):
        return tuple(weight.shape)
    return tuple(weight.get_shape())


def narrow_weight(weight: LoadedWeight, dim: int, start: int, size: int) -> LoadedWeight:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of `weight`, read only there."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, size)
    index = (slice(None),) * dim + (slice(start, start + size),)
    return weight[index]


def full_weight(weight: LoadedWeight) -> torch.Tensor:
    """The whole weight as a tensor (reading a lazy slice); ValueError for a packed weight,
    which only a quantized parameter's row store takes."""
    if isinstance(weight, torch.Tensor):
        return weight
    loaded = weight[...]
    if not isinstance(loaded, torch.Tensor):
        raise ValueError(f"a packed {type(weight).__name__} reached an unquantized parameter")
    return loaded


def copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}")
    target.copy_(loaded)


def set_row_store(param: nn.Parameter, store: RowStore, source_dtype: torch.dtype) -> None:
    """Route every write of `param`'s rows through `store`; dummy weights for it are drawn in
    `source_dtype` (the model's) and stored the same way."""
    param.row_store = store  # type: ignore[attr-defined]
    param.source_dtype = source_dtype  # type: ignore[attr-defined]


def row_store(param: nn.Parameter) -> RowStore | None:
    store: RowStore | None = getattr(param, "row_store", None)
    return store


def store_rows(param: nn.Parameter, offset: int, rows: LoadedWeight, what: str) -> None:
    """Write `rows` into `param`'s rows from `offset` on (through its `row_store`, if any)."""
    store = row_store(param)
    if store is not None:
        if offset + weight_shape(rows)[0] > param.shape[0]:
            raise ValueError(
                f"{what}: {weight_shape(rows)[0]} rows from {offset} overflow {tuple(param.shape)}"
            )
        store(offset, rows)
        return
    loaded = full_weight(rows)
    copy_checked(param.data.narrow(0, offset, loaded.shape[0]), loaded, what)


def default_weight_loader(param: nn.Parameter, weight: LoadedWeight, name: str = "") -> None:
    """A replicated parameter takes the whole weight, without a copy when it can."""
    if weight_shape(weight) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {weight_shape(weight)} != {tuple(param.shape)}")
    if row_store(param) is not None:
        store_rows(param, 0, weight, name)
        return
    loaded = full_weight(weight)
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
