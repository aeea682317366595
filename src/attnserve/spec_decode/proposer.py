"""`Proposer`: the one interface of speculative decoding's proposers on a rank.

After a step, a proposer sets the next step's draft tokens of each sequence the step's plan
drafts for (`StepPlan.draft_seq_ids`, chosen by the engine's pace) on that sequence's result
(`SampleOutput.draft_token_ids`); the engine takes as many as fit and sends them down with the
next step, which verifies them (`spec_decode.verifier`). `NgramProposer` looks the drafts up in
the sequence's own tokens, read from the target's batch (`TargetTokens`); `DraftModelProposer`
runs a draft model, which also takes in the steps it drafts nothing after (`take_in`).

A step that drafts runs synchronously; any other is launched as usual (`follow_later`), and is
read back, in launch order, when the engine reads it or at the latest before the next step that
drafts (`take_in_pending`): so the target's batch knows every token of the sequences it drafts
for, and a draft model takes in every step in order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Protocol

import numpy as np

from attnserve.step_types import AsyncStepOutput, SampleOutput, StepPlan, StepResults


class TargetTokens(Protocol):
    """What a proposer reads of the target's batch (the worker's `InputBatch`)."""

    def host_token_ids(self, seq_id: int) -> np.ndarray:
        """The sequence's tokens known on the host (all of them after a synchronous step)."""
        ...


class Proposer(ABC):
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self._pending: deque[tuple[StepPlan, AsyncStepOutput]] = deque()  # not read back yet

    @abstractmethod
    def propose_drafts(self, plan: StepPlan, results: StepResults, target: TargetTokens) -> None:
        """Having run `plan` (its `results`, taken in by the target's batch), set the drafts of
        the sequences it drafts for on their results."""

    def take_in(self, plan: StepPlan, results: StepResults) -> None:
        """A step launched without drafting, read back (nothing to do here)."""
        return None

    def follow_later(self, plan: StepPlan, launched: AsyncStepOutput) -> AsyncStepOutput:
        """The launched step's results, taken in (`take_in`) when they are read, after every
        step launched before it."""
        self._pending.append((plan, launched))
        return _ReadInOrder(self, launched)

    def take_in_pending(self, upto: AsyncStepOutput | None = None) -> None:
        """Read back and take in the steps launched by `follow_later`, oldest first: all of
        them, or those up to `upto` (none if it was taken in already)."""
        if upto is not None and all(launched is not upto for _, launched in self._pending):
            return
        while self._pending:
            plan, launched = self._pending.popleft()
            self.take_in(plan, launched.result())
            if launched is upto:
                return


class _ReadInOrder:
    """A launched step's results; reading them reads every step launched before it first."""

    def __init__(self, proposer: Proposer, launched: AsyncStepOutput) -> None:
        self._proposer = proposer
        self._launched = launched

    def result(self) -> StepResults:
        self._proposer.take_in_pending(upto=self._launched)
        return self._launched.result()


def drafting_results(plan: StepPlan, results: StepResults) -> list[tuple[int, SampleOutput]]:
    """(seq id, result) of each sequence the plan drafts for that drew this step."""
    wanted = set(plan.draft_seq_ids)
    return [
        (seq_id, result)
        for seq_id, result in zip(plan.seq_ids, results, strict=True)
        if seq_id in wanted and result is not None
    ]
