"""`Proposer`: steps launched without drafting are read back in launch order, whichever is read
first, and all of them before a step that drafts (`take_in_pending`); the n-gram proposer sets
drafts only on the results of the sequences the plan drafts for, from the target's tokens."""

from __future__ import annotations

import numpy as np

from attnserve.spec_decode.ngram_proposer import NgramProposer
from attnserve.step_types import SampleOutput, StepPlan, StepResults


class Launched:
    """A launched step whose results say when they were first read."""

    def __init__(self, name: str, reads: list[str]) -> None:
        self.name = name
        self.reads = reads
        self.results: StepResults = [SampleOutput([1])]

    def result(self) -> StepResults:
        if self.name not in self.reads:
            self.reads.append(self.name)
        return self.results


def test_steps_are_read_back_in_launch_order() -> None:
    proposer, reads = NgramProposer(2, 1, 2), []
    plan = StepPlan([0], [1])
    first, second, third = (Launched(name, reads) for name in ("first", "second", "third"))
    proposer.follow_later(plan, first)
    later = proposer.follow_later(plan, second)
    proposer.follow_later(plan, third)
    assert later.result() is second.results
    assert reads == ["first", "second"]
    proposer.take_in_pending()
    assert reads == ["first", "second", "third"]


class Target:
    def __init__(self, tokens: dict[int, list[int]]) -> None:
        self.tokens = tokens

    def host_token_ids(self, seq_id: int) -> np.ndarray:
        return np.asarray(self.tokens[seq_id], dtype=np.int64)


def test_ngram_drafts_go_on_the_results_of_the_drafting_sequences() -> None:
    proposer = NgramProposer(3, 1, 2)
    target = Target({1: [5, 6, 7, 8, 5, 6], 2: [5, 6, 7, 5, 6], 3: [5, 6, 5]})
    plan = StepPlan([1, 2, 3], [1, 1, 1], draft_seq_ids=[1, 3])
    results: StepResults = [SampleOutput([6]), SampleOutput([6]), None]
    proposer.propose_drafts(plan, results, target)
    assert [r.draft_token_ids if r is not None else None for r in results] == [
        [7, 8, 5],
        None,
        None,
    ]
