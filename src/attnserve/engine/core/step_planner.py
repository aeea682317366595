"""`StepPlanner`: what the ranks hold of each sequence, and the `StepPlan` that brings them up to
date for the step the scheduler chose.

A sequence the ranks do not hold (new, forked, or back from a preemption or a swap) goes down
whole as a `NewSequence`; one they hold sends only its block-table change, if any. Sequences that
stopped running since the last plan (finished, aborted, preempted, swapped out) are released, so
the ranks drop them before anything else. A step's token bitmask (structured outputs) is not
part of the plan: the pipeline hands it over once the step before is read back.
"""

from __future__ import annotations

from attnserve.engine.core.scheduler import SchedulerOutput
from attnserve.engine.core.sequence import Sequence, SequenceStatus
from attnserve.step_types import BlockUpdate, NewSequence, StepPlan


def _new_sequence(seq: Sequence) -> NewSequence:
    if seq.num_pending_tokens:
        raise RuntimeError(f"sequence {seq.seq_id} goes to the ranks with a draw still pending")
    seq.block_table.mark_synced()
    return NewSequence(
        seq.seq_id,
        list(seq.token_ids),
        seq.num_prompt_tokens,
        seq.num_computed_tokens,
        list(seq.block_table.blocks),
        seq.sampling_params,
        seq.index,
        1 + seq.num_forks_pending,
        [list(table) for table in seq.block_table.tables[1:]],
        lora_request=seq.lora_request,
    )


class StepPlanner:
    def __init__(self) -> None:
        self._held: dict[int, Sequence] = {}  # seq id -> the sequence the ranks hold

    def _released(self) -> list[int]:
        gone = [
            seq_id
            for seq_id, seq in self._held.items()
            if seq.status is not SequenceStatus.RUNNING or not seq.block_table.is_synced
        ]
        for seq_id in gone:
            del self._held[seq_id]
        return gone

    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The plan of one scheduled step (see the module docstring)."""
        released = self._released()
        new_seqs, updates = [], []
        for item in out.scheduled:
            seq = item.seq
            if seq.seq_id not in self._held:
                new_seqs.append(_new_sequence(seq))
                self._held[seq.seq_id] = seq
                continue
            update = seq.block_table.take_update()
            if update is not None:
                kept, (appended, *others) = update
                updates.append(BlockUpdate(seq.seq_id, kept, appended, tuple(others)))
        return StepPlan(
            seq_ids=[item.seq.seq_id for item in out.scheduled],
            num_new_tokens=[item.num_new_tokens for item in out.scheduled],
            new_seqs=new_seqs,
            block_updates=updates,
            released_seq_ids=released,
            blocks_to_swap_in=out.swap_in,
            blocks_to_swap_out=out.swap_out,
            blocks_to_copy=out.copies,
            spec_token_ids={
                i.seq.seq_id: i.spec_token_ids for i in out.scheduled if i.spec_token_ids
            },
            draft_seq_ids=out.draft_seq_ids,
        )
