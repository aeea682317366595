"""`DraftModelProposer`: speculative decoding's method "draft_model" on one rank — a second model
runner, of the draft model, whose KV cache holds as many blocks as the target's under the same
block ids, and whose persistent batch takes in every step's plan and kept tokens.

The draft computes only for the sequences it drafts for (the plan's `draft_seq_ids`; none while
the batch is large, none paused for failing): after the target's step it takes in the plan
(sequences, blocks) and the tokens the target kept, computing nothing; then, for each sequence
it drafts for, it catches up — one forward pass over every token of the sequence not yet in
its own cache (the step's new tokens, or everything since it last drafted, or the whole prompt),
whose last token's logits give the first draft — and proposes the rest greedily: forward steps
of one token each over its own cache, up to `num_speculative_tokens` drafts, as far as the
sequence's blocks reach (the engine reserves that many positions ahead) and its length
allows. Then it forgets its drafts again (`DraftRows.truncate`): the next step carries them to
the target to verify. A greedy draft proposes one token with certainty, so the verifier's
accept-while-equal rule keeps the target's distribution exactly.

A step that drafts for no sequence stays asynchronous: the worker launches it as usual, and the
draft takes it in when its results are read back (`Proposer.follow_later`), in launch order, at
the latest before the next step that drafts (`Proposer.take_in_pending`).

Blocks shared through prefix caching may hold the target's keys for positions the draft never
computed (it skipped the sequence that wrote them): the proposer keeps which full blocks its
own cache holds (`_valid`, following swaps and copies), and a new sequence counts as computed
in the draft only its cached prefix's leading valid blocks.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from attnserve.spec_decode.draft_rows import DraftRows
from attnserve.spec_decode.proposer import Proposer, TargetTokens, drafting_results
from attnserve.step_types import StepPlan, StepResults


class DraftBatch(Protocol):
    """The draft runner's persistent batch (the worker's `InputBatch`)."""

    block_size: int
    max_tokens: int
    num_tokens: np.ndarray
    num_computed: np.ndarray
    num_blocks: np.ndarray
    block_tables: np.ndarray  # [slots, groups, max_blocks]
    drafts: DraftRows

    def slot_of(self, seq_id: int) -> int: ...


class DraftRunner(Protocol):
    """The draft model's runner as the proposer drives it (the worker's `ModelRunner`)."""

    max_num_batched_tokens: int

    @property
    def input_batch(self) -> DraftBatch: ...

    @property
    def num_blocks(self) -> int: ...

    def apply_plan(self, plan: StepPlan) -> None: ...

    def draft_step(self, plan: StepPlan, draw: bool, decode_rows_up_to: int) -> list[int]: ...


class DraftModelProposer(Proposer):
    def __init__(self, runner: DraftRunner, num_speculative_tokens: int) -> None:
        super().__init__(num_speculative_tokens)
        self.runner = runner
        # a catch-up of the target's last round (its last token, the accepted drafts, the token
        # after them) runs as decode rows, as the target's verify step does
        self.decode_rows_up_to = num_speculative_tokens + 2
        self._valid = np.zeros(0, dtype=bool)  # block id -> the draft's keys fill it
        self._host_valid: dict[int, bool] = {}  # the same for swapped-out blocks

    def propose_drafts(self, plan: StepPlan, results: StepResults, target: TargetTokens) -> None:
        self.follow(plan, results)

    def take_in(self, plan: StepPlan, results: StepResults) -> None:
        self.follow(plan, results)

    @torch.inference_mode()
    def follow(self, plan: StepPlan, results: StepResults) -> None:
        """Take in the target's step, then set the drafts of each sequence the plan drafts for
        on its result (see the module docstring)."""
        self._move_validity(plan)
        self.runner.apply_plan(plan)
        batch = self.runner.input_batch
        for seq in plan.new_seqs:
            batch.num_computed[batch.slot_of(seq.seq_id)] = self._valid_prefix(
                seq.block_ids, seq.num_computed_tokens
            )
        batch.drafts.append_kept(
            plan.seq_ids, [None if r is None else r.token_ids for r in results]
        )
        drafting = drafting_results(plan, results)
        drafts = self._propose([seq_id for seq_id, _ in drafting])
        for (_, result), tokens in zip(drafting, drafts, strict=True):
            result.draft_token_ids = tokens

    def _move_validity(self, plan: StepPlan) -> None:
        """Blocks keep what the draft computed through swaps and copies; blocks newly given to
        a sequence hold nothing of it yet."""
        if len(self._valid) == 0:
            self._valid = np.zeros(self.runner.num_blocks, dtype=bool)
        valid = self._valid
        for device_block, host_block in plan.blocks_to_swap_out:
            self._host_valid[host_block] = bool(valid[device_block])
        for host_block, device_block in plan.blocks_to_swap_in:
            valid[device_block] = self._host_valid.pop(host_block, False)
        for src, dst in plan.blocks_to_copy:
            valid[dst] = valid[src]
        block_size = self.runner.input_batch.block_size
        for seq in plan.new_seqs:
            valid[seq.block_ids[-(-seq.num_computed_tokens // block_size) :]] = False
        for update in plan.block_updates:
            valid[update.appended] = False

    def _valid_prefix(self, block_ids: list[int], num_computed: int) -> int:
        """How many of a new sequence's `num_computed` cached tokens the draft's cache holds:
        those of its leading valid blocks."""
        block_size = self.runner.input_batch.block_size
        cached = self._valid[block_ids[: num_computed // block_size]]
        leading = len(cached) if cached.all() else int(np.argmin(cached))
        return min(leading * block_size, num_computed)

    def _room(self, slots: np.ndarray) -> np.ndarray:
        """How many drafts each slot's sequence may get: its blocks must hold the positions the
        draft steps write (its last token's and all drafts' but the last), and its tokens fit."""
        batch = self.runner.input_batch
        num_tokens = batch.num_tokens[slots]
        capacity = batch.num_blocks[slots] * batch.block_size
        room = np.minimum(capacity - num_tokens + 1, batch.max_tokens - num_tokens - 1)
        return np.clip(room, 0, self.num_speculative_tokens)

    def _propose(self, seq_ids: list[int]) -> list[list[int]]:
        """Each sequence's drafts: the catch-up pass, then greedy one-token steps of the draft
        over its cache, undone after."""
        batch = self.runner.input_batch
        slots = np.fromiter(map(batch.slot_of, seq_ids), np.int64, len(seq_ids))
        room = self._room(slots)
        drafts: list[list[int]] = [[] for _ in seq_ids]
        active = [i for i in range(len(seq_ids)) if room[i] > 0]
        if not active:
            return drafts
        self._catch_up([seq_ids[i] for i in active], slots[active])
        for ahead in range(int(room.max())):
            behind = batch.num_tokens[slots] - batch.num_computed[slots]
            active = _prefills_first([i for i in active if room[i] > ahead], behind)
            plan = StepPlan([seq_ids[i] for i in active], behind[active].tolist())
            drawn = self.runner.draft_step(plan, True, self.decode_rows_up_to)
            for i, token in zip(active, drawn, strict=True):
                drafts[i].append(token)
            if ahead == 0:
                self._mark_valid(slots[active])
        batch.drafts.truncate(slots, room)
        return drafts

    def _catch_up(self, seq_ids: list[int], slots: np.ndarray) -> None:
        """Compute the sequences' tokens that are not in the draft's cache, in passes of at most
        the runner's token budget, all but the last of each sequence (the first draft step
        computes that one, and more where the budget allows)."""
        batch = self.runner.input_batch
        budget = self.runner.max_num_batched_tokens
        while True:
            behind = batch.num_tokens[slots] - batch.num_computed[slots]
            wanted = behind - 1
            counts = np.clip(budget - (np.cumsum(wanted) - wanted), 0, wanted)
            if behind.sum() <= budget or not counts.any():
                return
            chosen = _prefills_first(np.flatnonzero(counts).tolist(), counts)
            plan = StepPlan([seq_ids[i] for i in chosen], counts[chosen].tolist())
            self.runner.draft_step(plan, False, self.decode_rows_up_to)

    def _mark_valid(self, slots: np.ndarray) -> None:
        """The blocks the draft's cache now fills for each slot's sequence (its computed
        tokens' full blocks)."""
        batch = self.runner.input_batch
        full = batch.num_computed[slots] // batch.block_size
        for slot, count in zip(slots.tolist(), full.tolist(), strict=True):
            self._valid[batch.block_tables[slot, 0, :count]] = True


def _prefills_first(rows: list[int], counts: np.ndarray) -> list[int]:
    """`rows` with those computing more than one token first (a step's layout puts its
    prefills before its decodes)."""
    return sorted(rows, key=lambda row: bool(counts[row] == 1))
