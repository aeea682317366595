"""`piecewise_sizes`: the token buckets of the piecewise graphs, and the largest-first capture
both graph runners share (the runners themselves need CUDA: tests/gpu/test_hf_parity.py replays
them against eager steps and HF)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from attnserve.worker.graphs.base import capture_largest_first
from attnserve.worker.graphs.piecewise import MAX_PIECEWISE_TOKENS, piecewise_sizes


def test_buckets_are_dense_below_a_thousand_and_capped() -> None:
    sizes = piecewise_sizes(8192)
    assert sizes[:4] == [16, 32, 48, 64] and len(sizes) == 23
    assert sizes[-1] == MAX_PIECEWISE_TOKENS == 2048
    assert sizes == sorted(set(sizes))
    from_96 = sizes[sizes.index(96) :]
    padding = max((b - a) / a for a, b in pairwise(from_96))
    assert padding <= 1 / 3  # from 96 tokens up a step pads by at most a third


@pytest.mark.parametrize(("budget", "top"), [(100, 100), (1024, 1024), (1000, 1000), (16, 16)])
def test_the_largest_bucket_is_the_step_budget_below_the_cap(budget: int, top: int) -> None:
    sizes = piecewise_sizes(budget)
    assert sizes[-1] == top and all(s < top for s in sizes[:-1])


def test_buckets_are_captured_largest_first_into_one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both graph runners capture through `capture_largest_first` (CUDA-free here)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls: list[tuple[int, object]] = []

    def capture_one(size: int, pool: object) -> object:
        calls.append((size, pool))
        return pool or f"pool of {size}"

    assert capture_largest_first([16, 32, 64], capture_one) >= 0
    assert calls == [(64, None), (32, "pool of 64"), (16, "pool of 64")]
