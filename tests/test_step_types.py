"""The step's shared types: the one prefill rule, on Python ints and numpy arrays alike, and a
plan of new sequences."""

from __future__ import annotations

import numpy as np

from attnserve.step_types import NewSequence, StepPlan, is_prefill


def test_is_prefill_on_ints() -> None:
    assert is_prefill(5, 0)  # a prompt
    assert is_prefill(1, 0)  # a one-token prompt
    assert is_prefill(3, 16)  # a later chunk of a chunked prompt
    assert not is_prefill(1, 16)  # a decode


def test_is_prefill_on_arrays_agrees_with_ints() -> None:
    query = np.array([5, 1, 3, 1], dtype=np.int64)
    context = np.array([0, 0, 16, 16], dtype=np.int64)
    flags = is_prefill(query, context)
    assert flags.dtype == np.bool_
    pairs = zip(query.tolist(), context.tolist(), strict=True)
    assert flags.tolist() == [is_prefill(q, c) for q, c in pairs]


def test_a_plan_of_new_sequences_computes_what_is_not_cached() -> None:
    plan = StepPlan.of_new(
        [NewSequence(7, [1, 2, 3], 3, 0, [0]), NewSequence(8, [1, 2, 3, 4], 4, 3, [0])]
    )
    assert plan.seq_ids == [7, 8] and plan.num_new_tokens == [3, 1]
    assert plan.num_tokens == 4 and plan.new_seqs[1].num_computed_tokens == 3
