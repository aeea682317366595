"""`Linear`: a thin, uninitialised linear layer, and merged (stacked) projections.

Parameters start uninitialised (the loader fills them), so building a large model costs no
random init. A merged layer stacks several logical projections (q/k/v, gate/up) along the
output dimension so they run as one matmul; `load_shard` copies one HF projection into its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input, stacked on the output dimension."""

    def __init__(
        self, in_features: int, shard_sizes: Sequence[int], shard_names: Sequence[str], bias: bool
    ) -> None:
        if len(shard_sizes) != len(shard_names):
            raise ValueError("one name per shard size")
        super().__init__(in_features, sum(shard_sizes), bias)
        starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shards = {
            name: (start, size)
            for name, start, size in zip(shard_names, starts, shard_sizes, strict=True)
        }

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        """Copy one projection's weight (or bias) into its rows of the merged `param`."""
        if shard not in self.shards:
            raise ValueError(f"unknown shard {shard!r}; this layer has {list(self.shards)}")
        start, size = self.shards[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}"
            )
        target.copy_(loaded)
