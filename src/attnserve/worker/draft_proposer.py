"""`DraftProposer`: the draft model of speculative decoding on one rank — a second
`ModelRunner`, of the draft model, whose KV cache holds as many blocks as the target's under the
same block ids, and whose persistent batch follows the target's step by step.

After the target has run a step, the draft runs the same plan's tokens through its own model
(so its cache holds what the target's holds), takes in the tokens the target kept, and then,
for each sequence that drew, proposes drafts greedily: forward steps of one token each over its
own cache, up to `num_speculative_tokens`, as far as the sequence's blocks reach (the scheduler
allocates that many positions ahead) and its length allows. Then it forgets its drafts again
(`InputBatch.truncate`): the next step carries them to the target to verify, and the draft runs
them with that step's plan. A greedy draft proposes one token with certainty, so the verifier's
accept-while-equal rule keeps the target's distribution exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from attnserve.step_types import SampleOutput, StepPlan, StepResults
from attnserve.worker.input_batch import PreparedStep
from attnserve.worker.model_runner import ModelRunner


class DraftProposer:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens

    @torch.inference_mode()
    def follow(self, plan: StepPlan, results: StepResults) -> None:
        """Run the target's step on the draft too, then set each drawing sequence's result's
        `draft_token_ids` (see the module docstring)."""
        step, _ = self.runner.forward_plan(plan)
        batch = self.runner.input_batch
        batch.accept_results(step, results)
        if not plan.propose_drafts:  # a large batch: the draft only keeps its cache up
            return
        rows = [row for row in step.sample_rows if results[row] is not None]
        drafts = self._propose(step, rows, [plan.seq_ids[row] for row in rows])
        for row, tokens in zip(rows, drafts, strict=True):
            result = results[row]
            if result is not None:
                result.draft_token_ids = tokens

    def _room(self, step: PreparedStep, rows: list[int]) -> np.ndarray:
        """How many drafts each row's sequence may get: its blocks must hold the positions the
        draft steps write (its last token's and all drafts' but the last), and its tokens fit."""
        batch = self.runner.input_batch
        slots = step.slots[rows]
        num_tokens = batch.num_tokens[slots]
        capacity = batch.num_blocks[slots] * batch.block_size
        room = np.minimum(capacity - num_tokens + 1, batch.max_tokens - num_tokens - 1)
        return np.clip(room, 0, self.num_speculative_tokens)

    def _propose(self, step: PreparedStep, rows: list[int], seq_ids: list[int]) -> list[list[int]]:
        """Each row's drafts (`seq_ids`: the rows' sequences): greedy one-token steps of the
        draft over its cache, undone after."""
        room = self._room(step, rows)
        drafts: list[list[int]] = [[] for _ in rows]
        for ahead in range(int(room.max(initial=0))):
            active = [i for i in range(len(rows)) if room[i] > ahead]
            plan = StepPlan([seq_ids[i] for i in active], [1] * len(active))
            draft_step, hidden = self.runner.forward_plan(plan)
            tokens = self.runner.model.compute_logits(hidden).argmax(dim=-1)
            drawn: list[int] = tokens.tolist()
            drawn_results: StepResults = [SampleOutput([token]) for token in drawn]
            self.runner.input_batch.accept_results(draft_step, drawn_results)
            for i, token in zip(active, drawn, strict=True):
                drafts[i].append(token)
        slots = step.slots[rows]
        self.runner.input_batch.truncate(slots, room)
        return drafts
