"""`piecewise_sizes`: the token buckets of the piecewise graphs (the runner itself needs CUDA:
tests/gpu/test_hf_parity.py replays it against eager steps and HF)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from attnserve.worker.piecewise_graph import MAX_PIECEWISE_TOKENS, piecewise_sizes


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
