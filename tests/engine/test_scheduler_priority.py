"""The "priority" scheduling policy (vLLM's) against "fcfs": waiting requests start by
(priority, arrival), lower first, and a full KV cache preempts the lowest priority first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attnserve.config import SchedulerConfig
from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.scheduler import Scheduler
from attnserve.engine.core.sequence import Sequence, SequenceStatus
from attnserve.engine.llm_engine import LLMEngine
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput
from tests.engine.scheduler_steps import record_step

BLOCK = 4


def _scheduler(policy: str, blocks: int = 64, seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=64, max_model_len=512, scheduling_policy=policy
    )
    return Scheduler(config, BlockAllocator(blocks))


def _add(s: Scheduler, rid: str, priority: int, prompt_len: int = 7) -> Sequence:
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    seq = Sequence(rid, [1] * prompt_len, params, BlockTable(s.allocator, BLOCK), priority=priority)
    s.add(seq)
    return seq


def _step(s: Scheduler) -> list[str]:
    """One step; the request ids it scheduled."""
    out = s.schedule()
    results = [SampleOutput([7]) if item.samples else None for item in out.scheduled]
    record_step(s, out, results, [0])
    return [item.seq.request_id for item in out.scheduled]


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["c", "d", "b", "a"])]
)
def test_waiting_requests_start_by_priority_then_arrival(policy: str, order: list[str]) -> None:
    s = _scheduler(policy, seqs=1)
    for rid, priority in [("a", 5), ("b", 1), ("c", 0), ("d", 0)]:
        _add(s, rid, priority)
    started = []
    while s.has_work():
        for rid in _step(s):
            if rid not in started:
                started.append(rid)
    assert started == order


def test_an_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        _scheduler("lifo")


@pytest.mark.parametrize(("policy", "preempted"), [("fcfs", "high"), ("priority", "low")])
def test_a_full_cache_preempts_the_lowest_priority_first(policy: str, preempted: str) -> None:
    """`low` (priority 9) runs first, `high` (priority 0) joins it; their prompts (7 tokens) and
    first tokens fill the 4 blocks, so the next decode needs a block: fcfs preempts the newest
    (`high`), priority the lowest priority (`low`, though it arrived first)."""
    s = _scheduler(policy, blocks=4)
    seqs = {"low": _add(s, "low", 9)}
    _step(s)
    seqs["high"] = _add(s, "high", 0)
    _step(s)
    assert s.allocator.num_free_blocks == 0
    _step(s)
    assert s.num_preemptions == 1
    assert seqs[preempted].status is SequenceStatus.WAITING
    kept = "low" if preempted == "high" else "high"
    assert seqs[kept].status is SequenceStatus.RUNNING


def test_an_engine_runs_requests_by_priority_through_the_core(tiny_llama_dir: Path) -> None:
    """End to end (front end, `EngineCoreRequest`, core): one sequence at a time under
    "priority", the later request of priority 0 is done before the earlier one of priority 5
    starts; under "fcfs" a non-zero priority is refused."""
    args = EngineArgs(
        str(tiny_llama_dir),
        device="cpu",
        engine_core_process=False,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    engine = LLMEngine(args)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("late-urgent", [5, 6, 7], params, priority=0)
    engine.add_request("early-lax", [5, 6, 7], params, priority=5)
    engine.add_request("later-urgent", [5, 6, 7], params, priority=0)
    done = []
    while engine.has_unfinished_requests():
        done += [out.request_id for out in engine.step() if out.finished]
    assert done == ["late-urgent", "later-urgent", "early-lax"]
    engine.shutdown()
    fcfs = LLMEngine(dataclasses.replace(args, scheduling_policy="fcfs"))
    with pytest.raises(ValueError, match="needs --scheduling-policy priority"):
        fcfs.add_request("urgent", [5, 6, 7], params, priority=-1)
    fcfs.shutdown()
