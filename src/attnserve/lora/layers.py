"""The LoRA side of one base projection (`LoRALinear`, the layer's `lora` addend) and the
step's per-token adapter slots every projection reads (`LoRAIndices`).

A merged projection (q/k/v, gate/up) keeps one slice per projection: A's rows of slice j are
j·R .. j·R + r of its stacked A, and B's rows are the layer's own output rows of that slice.
Under tensor parallelism the adapter is split as the base weight is: a column-parallel layer
keeps its rows of each slice's B (A whole), a row-parallel one its columns of A (B whole), whose
partial products the layer's all-reduce sums with the base output's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnserve.host_copy import to_device
from attnserve.lora.peft import LoRAWeights
from attnserve.lora.punica import add_lora_torch
from attnserve.model.layers.linear import ColumnParallelLinear, Linear, MergedColumnParallelLinear
from attnserve.model.layers.ops import use_triton


class LoRAIndices:
    """Each new token's adapter slot (-1: none) for the step being run, and the tokens sorted by
    slot (the kernels take them in that order), in persistent device buffers: graphs capture
    their addresses; a padded row past the step's tokens reads slot -1 and keeps its place."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.order = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self._host = np.full((2, max_tokens), -1, dtype=np.int32)  # slots, order
        self._host[1] = np.arange(max_tokens)
        self._used = 0
        self.active = False  # whether any token of the step has an adapter

    def set(self, token_slots: np.ndarray) -> None:
        """This step's slots, one per new token in the step's order."""
        count = len(token_slots)
        if count > self._host.shape[1]:
            raise ValueError(f"a step of {count} tokens; the LoRA slots hold {self._host.shape[1]}")
        end = max(count, self._used)
        self._host[0, :count] = token_slots
        self._host[0, count:end] = -1
        self._host[1, :count] = np.argsort(token_slots, kind="stable")
        self._host[1, count:end] = np.arange(count, end)
        both = to_device(torch.from_numpy(self._host[:, :end].copy()), self.device)
        self.slots[:end].copy_(both[0])
        self.order[:end].copy_(both[1])
        self._used = count
        self.active = bool((token_slots >= 0).any())

    def for_tokens(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots of a forward's `count` tokens, and those tokens in slot order."""
        if count > self._host.shape[1]:
            raise RuntimeError(
                f"a forward of {count} tokens; the LoRA slots hold {self._host.shape[1]}"
            )
        return self.slots[:count], self.order[:count]


@dataclass(frozen=True)
class LoRASlice:
    """One projection of a layer: its PEFT module name, where its rows lie in this rank's
    output (`offset`, `size`) and which rows of the full projection they are (from `start`)."""

    module: str
    offset: int
    size: int
    start: int


def layer_slices(base: Linear, modules: tuple[str, ...]) -> list[LoRASlice]:
    """The slices of `base`, whose projections are `modules` in order."""
    if isinstance(base, MergedColumnParallelLinear):
        specs = list(base.specs.values())
        if len(specs) != len(modules):
            raise ValueError(f"a merged layer of {len(specs)} projections, named {modules}")
        return [
            LoRASlice(m, s.local_offset, s.local_size, s.rank_start)
            for m, s in zip(modules, specs, strict=True)
        ]
    start = base.tp_rank * base.out_features if isinstance(base, ColumnParallelLinear) else 0
    return [LoRASlice(modules[0], 0, base.out_features, start)]


def column_slices(spans: list[tuple[int, int]], width: int, device: torch.device) -> torch.Tensor:
    """[width] int32: the slice of each output column (`spans`: each slice's first column and
    width, in order, covering every column)."""
    col_slice = torch.full((width,), -1, dtype=torch.int32)
    for j, (start, size) in enumerate(spans):
        col_slice[start : start + size] = j
    if bool((col_slice < 0).any()):
        raise ValueError(f"LoRA slices {spans} leave columns of {width} uncovered")
    return col_slice.to(device)


class LoRALinear:
    """The adapters of `max_loras` slots for one base projection, added to its output."""

    def __init__(
        self,
        base: Linear,
        modules: tuple[str, ...],
        indices: LoRAIndices,
        shape: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        max_loras, self.rank = shape
        self.slices = layer_slices(base, modules)
        self.indices = indices
        tp_rank = getattr(base, "tp_rank", 0)
        self.in_start = tp_rank * base.in_features if base.shards_input else 0
        self.in_size = base.in_features
        device = indices.device
        rows = len(self.slices) * self.rank
        self.lora_a = torch.zeros(max_loras, rows, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(
            max_loras, base.out_features, self.rank, dtype=dtype, device=device
        )
        self.spans = [(part.offset, part.size) for part in self.slices]
        self.col_slice = column_slices(self.spans, base.out_features, device)

    @property
    def num_bytes(self) -> int:
        return self.lora_a.nbytes + self.lora_b.nbytes

    def set_slot(self, slot: int, weights: dict[str, LoRAWeights], scaling: float) -> None:
        """Slot `slot` holds these projections' weights (by module name; others zero)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for j, part in enumerate(self.slices):
            pair = weights.get(part.module)
            if pair is None:
                continue
            rank = pair.lora_a.shape[0]
            a = pair.lora_a[:, self.in_start : self.in_start + self.in_size]
            b = pair.lora_b[part.start : part.start + part.size] * scaling
            self.lora_a[slot, j * self.rank : j * self.rank + rank].copy_(a)
            self.lora_b[slot, part.offset : part.offset + part.size, :rank].copy_(b)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        slots = self.indices.for_tokens(x.shape[0])
        if use_triton(out):
            from attnserve.lora.triton_ops import add_lora_triton

            return add_lora_triton(x, out, slots, self.lora_a, self.lora_b, self.col_slice)
        if not self.indices.active:  # the torch path runs eagerly: no graph records this
            return out
        return add_lora_torch(x, out, slots[0], self.lora_a, self.lora_b, self.spans)
