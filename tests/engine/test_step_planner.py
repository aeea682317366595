"""`StepPlanner`: a sequence goes to the ranks whole once, then only as its block-table changes;
a sequence that stops running is released, and one back from a preemption goes whole again."""

from __future__ import annotations

import pytest

from attnserve.config import SchedulerConfig
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.scheduler import Scheduler
from attnserve.engine.core.sequence import Sequence
from attnserve.engine.core.step_planner import StepPlanner
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import BlockUpdate, SampleOutput, StepPlan
from tests.engine.scheduler_steps import record_step

EOS = 0


def _scheduler(blocks: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, BlockAllocator(blocks))


def _seq(s: Scheduler, prompt: list[int], n: int = 1) -> Sequence:
    params = SamplingParams(n=n, max_tokens=20, ignore_eos=True)
    seq = Sequence("r", prompt, params, BlockTable(s.allocator, 4))
    s.add(seq)
    return seq


def _run(s: Scheduler, planner: StepPlanner) -> StepPlan:
    """Plan one scheduled step, then give every sampling sequence token 7 (one per fork)."""
    out = s.schedule()
    plan = planner.plan(out)
    draws = [SampleOutput([7] * (1 + i.seq.num_forks_pending)) for i in out.scheduled]
    record_step(
        s, out, [d if i.samples else None for d, i in zip(draws, out.scheduled, strict=True)], [EOS]
    )
    return plan


def test_a_sequence_goes_whole_once_then_as_its_new_blocks() -> None:
    s, planner = _scheduler(), StepPlanner()
    seq = _seq(s, [1, 2, 3, 4], n=2)
    plan = _run(s, planner)
    (new,) = plan.new_seqs
    assert (new.seq_id, new.token_ids, new.num_computed_tokens) == (seq.seq_id, [1, 2, 3, 4], 0)
    assert new.block_ids == seq.block_table.blocks and new.num_first_draws == 2
    fork = next(x for x in s.running if x is not seq)
    plan = _run(s, planner)  # the fork is new; its first write copies the shared block
    assert [n.seq_id for n in plan.new_seqs] == [fork.seq_id]
    assert plan.block_updates == [BlockUpdate(seq.seq_id, 1, seq.block_table.blocks[1:])]
    plan = _run(s, planner)  # both write inside blocks they hold: nothing to send
    assert plan.new_seqs == [] and plan.block_updates == []
    assert plan.num_new_tokens == [1, 1]


def test_a_preempted_sequence_is_released_and_comes_back_whole() -> None:
    s, planner = _scheduler(), StepPlanner()
    seq = _seq(s, [1, 2, 3])
    _run(s, planner)
    s.running.remove(seq)
    seq.reset_for_recompute()
    s.waiting.appendleft(seq)
    plan = _run(s, planner)
    assert plan.released_seq_ids == [seq.seq_id]
    (new,) = plan.new_seqs
    assert new.token_ids == [1, 2, 3, 7] and new.num_prompt_tokens == 3


def test_a_finished_sequence_is_released_by_the_next_plan() -> None:
    s, planner = _scheduler(), StepPlanner()
    first, second = _seq(s, [1, 2]), _seq(s, [3, 4])
    _run(s, planner)
    s.finish(first, "stop")
    plan = _run(s, planner)
    assert plan.released_seq_ids == [first.seq_id]
    assert plan.seq_ids == [second.seq_id]


def test_a_sequence_with_a_draw_in_flight_cannot_go_whole() -> None:
    s, planner = _scheduler(), StepPlanner()
    seq = _seq(s, [1, 2])
    seq.num_pending_tokens = 1
    with pytest.raises(RuntimeError, match="still pending"):
        planner.plan(s.schedule())
