"""Scheduler: long prompts share the step's token budget with short ones (vLLM's
`long_prefill_token_threshold` / `max_long_partial_prefills`)."""

from __future__ import annotations

import pytest

from attnserve.config import SchedulerConfig
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.scheduler import ScheduledSequence, Scheduler
from attnserve.engine.core.sequence import Sequence
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput
from tests.engine.scheduler_steps import record_step

BUDGET = 512
THRESHOLD = 100


def _scheduler(blocks: int = 4096, max_long: int = 1) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=BUDGET,
        max_model_len=8192,
        long_prefill_token_threshold=THRESHOLD,
        max_long_partial_prefills=max_long,
    )
    return Scheduler(config, BlockAllocator(blocks), None)


def _add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 2) -> Sequence:
    seq = Sequence(
        rid,
        list(range(1, prompt_len + 1)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        BlockTable(s.allocator, 16),
    )
    s.add(seq)
    return seq


def _step(s: Scheduler) -> list[ScheduledSequence]:
    out = s.schedule()
    record_step(s, out, [SampleOutput([7]) if i.samples else None for i in out.scheduled], [0])
    return out.scheduled


def _mid_prefill(s: Scheduler) -> int:
    return sum(0 < seq.num_computed_tokens < len(seq.prompt_token_ids) for seq in s.running)


def test_a_short_prompt_starts_in_the_step_after_it_arrives_behind_96k_prompt_tokens() -> None:
    s = _scheduler()
    longs = [_add(s, f"long-{i}", 6000, max_tokens=1) for i in range(16)]
    for _ in range(3):
        _step(s)
    short = _add(s, "short", 20)
    scheduled = _step(s)
    assert short in [item.seq for item in scheduled]
    assert short.queued_steps == 1
    assert sum(item.num_new_tokens for item in scheduled) == BUDGET  # the rest still used
    assert any(item.seq in longs for item in scheduled)


def test_at_most_max_long_partial_prefills_long_prompts_are_left_mid_prefill() -> None:
    for max_long in (1, 2):
        s = _scheduler(max_long=max_long)
        for i in range(6):
            _add(s, f"long-{i}", 700, max_tokens=1)
        while s.has_work():
            _step(s)
            assert _mid_prefill(s) <= max_long


def test_long_prompts_that_finish_within_the_step_leave_no_budget_unused() -> None:
    s = _scheduler()
    for i in range(4):
        _add(s, f"long-{i}", 200, max_tokens=1)
    first = _step(s)
    assert [item.num_new_tokens for item in first] == [200, 200, 112]
    assert _mid_prefill(s) == 1


def test_short_prompts_start_before_older_long_ones() -> None:
    s = _scheduler()
    long = _add(s, "long", 3000)
    shorts = [_add(s, f"short-{i}", 50) for i in range(3)]
    scheduled = _step(s)
    assert [item.seq for item in scheduled] == [*shorts, long]
    assert [item.num_new_tokens for item in scheduled] == [50, 50, 50, BUDGET - 150]


def test_a_lone_long_prompt_takes_the_whole_budget() -> None:
    s = _scheduler()
    long = _add(s, "long", 3000)
    for _ in range(2):
        assert [(i.seq, i.num_new_tokens) for i in _step(s)] == [(long, BUDGET)]


def test_the_default_threshold_is_vllms_share_of_max_model_len() -> None:
    config = SchedulerConfig(max_model_len=10000)
    assert config.long_prefill_tokens == 400
    assert SchedulerConfig(long_prefill_token_threshold=77).long_prefill_tokens == 77


@pytest.mark.parametrize(
    ("field", "value"), [("long_prefill_token_threshold", -1), ("max_long_partial_prefills", 0)]
)
def test_bad_limits_are_refused_by_name(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})
