"""Scheduler: budgets, chunked prefill, decode priority, preemption by recompute, no leaks."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.config import SchedulerConfig
from attnserve.engine.core.block_allocator import BlockAllocator, chain_hash
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.scheduler import ScheduledSequence, Scheduler
from attnserve.engine.core.sequence import Sequence, SequenceStatus
from attnserve.engine.core.step_planner import StepPlanner
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput
from tests.engine.scheduler_steps import record_step

EOS = 0


def _scheduler(
    blocks: int = 64,
    seqs: int = 8,
    tokens: int = 64,
    prefix_caching: bool = False,
    swap_blocks: int = 0,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        max_model_len=512,
        preemption_mode="swap" if swap_blocks else "recompute",
    )
    return Scheduler(
        config,
        BlockAllocator(blocks, enable_prefix_caching=prefix_caching),
        BlockAllocator(swap_blocks) if swap_blocks else None,
    )


def _add(
    s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, first: int = 1, n: int = 1
) -> Sequence:
    seq = Sequence(
        rid,
        list(range(first, first + prompt_len)),
        SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
        BlockTable(s.allocator, 4),
    )
    s.add(seq)
    return seq


def _step(s: Scheduler) -> list[ScheduledSequence]:
    out = s.schedule()
    assert all(item.seq.status is SequenceStatus.RUNNING for item in out.scheduled)
    results = [
        SampleOutput([7] * (1 + item.seq.num_forks_pending)) if item.samples else None
        for item in out.scheduled
    ]
    record_step(s, out, results, [EOS])
    return out.scheduled


def _unfinished(s: Scheduler) -> bool:
    """Whether any sequence is still queued: waiting, running or swapped out."""
    return bool(s.waiting or s.running or s.swapped)


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    s = _scheduler(tokens=16)
    short = _add(s, "short", 3)
    _step(s)  # short prefilled, first token sampled
    long = _add(s, "long", 40)
    steps = [_step(s) for _ in range(3)]
    for scheduled in steps:
        assert scheduled[-1].seq is short and scheduled[-1].num_new_tokens == 1  # decode last
        assert sum(item.num_new_tokens for item in scheduled) <= 16
    assert [item.num_new_tokens for item in steps[0] if item.seq is long] == [15]
    assert long.num_computed_tokens == 40 and len(long.output_token_ids) == 1


def test_decodes_take_their_token_before_an_older_prompt_chunk() -> None:
    s = _scheduler(tokens=16)
    decoding = _add(s, "decoding", 3)
    _step(s)
    prompt = _add(s, "prompt", 40)
    _step(s)  # the decode's token, then the prompt's first chunk of 15
    s.running.reverse()  # the prompt first: the policy must not depend on the running order
    scheduled = {item.seq.request_id: item.num_new_tokens for item in _step(s)}
    assert scheduled == {"decoding": 1, "prompt": 15}
    assert decoding.num_output_tokens == 3 and prompt.num_computed_tokens == 30


def test_a_long_prompt_advances_every_step_beside_decodes() -> None:
    s = _scheduler(seqs=8, tokens=8)
    decoders = [_add(s, f"d{i}", 2, max_tokens=20) for i in range(3)]
    _step(s)
    long = _add(s, "long", 40)
    for step in range(8):
        scheduled = {item.seq.request_id: item.num_new_tokens for item in _step(s)}
        assert scheduled == {"d0": 1, "d1": 1, "d2": 1, "long": 5}, step
    assert long.num_computed_tokens == 40 and long.num_output_tokens == 1
    assert all(d.num_output_tokens == 9 for d in decoders)


def test_a_prompt_chunk_waits_instead_of_preempting_this_steps_decode() -> None:
    s = _scheduler(blocks=5, tokens=8)  # blocks of 4 tokens
    decoding = _add(s, "decoding", 4, max_tokens=12)
    _step(s)
    prompt = _add(s, "prompt", 14, max_tokens=2)
    _step(s)  # the decode's token (a second block), the prompt's first 7 tokens (2 blocks)
    assert prompt.num_computed_tokens == 7 and s.allocator.num_free_blocks == 1
    scheduled = [item.seq for item in _step(s)]  # the next 7 would need 2 blocks: 1 is free
    assert scheduled == [decoding] and s.num_preemptions == 0
    assert prompt.status is SequenceStatus.RUNNING and len(prompt.block_table.blocks) == 2
    while _unfinished(s):
        _step(s)
    assert decoding.output_token_ids == [7] * 12 and prompt.output_token_ids == [7] * 2
    assert s.allocator.num_free_blocks == 5


def test_plan_puts_prefills_before_decodes() -> None:
    s = _scheduler()
    a = _add(s, "a", 3)
    planner = StepPlanner()
    out = s.schedule()
    planner.plan(out)
    record_step(s, out, [SampleOutput([7])], [EOS])
    b = _add(s, "b", 5)
    plan = planner.plan(s.schedule())
    assert plan.seq_ids == [b.seq_id, a.seq_id] and plan.num_new_tokens == [5, 1]
    assert [n.seq_id for n in plan.new_seqs] == [b.seq_id]  # a is held already


def test_max_num_seqs_bounds_the_batch() -> None:
    s = _scheduler(seqs=2)
    for i in range(5):
        _add(s, str(i), 2)
    assert len(s.schedule().scheduled) == 2


def test_out_of_blocks_preempts_newest_and_recomputes() -> None:
    s = _scheduler(blocks=4, tokens=64)
    old = _add(s, "old", 7, max_tokens=6)  # 2 blocks, grows to 13 tokens -> 4 blocks
    new = _add(s, "new", 7, max_tokens=6)
    _step(s)
    while _unfinished(s):
        _step(s)
        assert s.allocator.num_free_blocks + sum(len(q.block_table.blocks) for q in (old, new)) == 4
    assert s.num_preemptions >= 1
    assert old.finish_reason == new.finish_reason == "length"
    assert old.output_token_ids == new.output_token_ids == [7] * 6
    assert s.allocator.num_free_blocks == 4


def test_abort_frees_blocks_at_once() -> None:
    s = _scheduler()
    _add(s, "a", 9)
    _step(s)
    assert s.allocator.num_free_blocks < 64
    (aborted,) = s.abort("a")
    assert aborted.finish_reason == "abort"
    assert s.allocator.num_free_blocks == 64 and not _unfinished(s)
    assert s.abort("missing") == []


def test_stop_token_and_eos_finish_with_stop() -> None:
    s = _scheduler()
    seq = Sequence("x", [1, 2], SamplingParams(max_tokens=9), BlockTable(s.allocator, 4))
    s.add(seq)
    record_step(s, s.schedule(), [SampleOutput([EOS])], [EOS])
    assert seq.finish_reason == "stop" and seq.output_token_ids == [EOS]


def test_prefix_cache_reuses_blocks_of_an_earlier_request() -> None:
    s = _scheduler(prefix_caching=True)
    first = _add(s, "first", 13, max_tokens=2)
    while _unfinished(s):
        _step(s)
    assert first.finish_reason == "length"
    second = _add(s, "second", 13, max_tokens=2)
    (item,) = s.schedule().scheduled
    assert item.seq is second and second.num_computed_tokens == 12 and item.num_new_tokens == 1
    assert s.allocator.prefix_hit_rate > 0
    other = _add(s, "other", 13, first=100)  # different tokens: no hit
    s.schedule()
    assert other.num_computed_tokens == 0


def _all_seqs(s: Scheduler) -> list[Sequence]:
    return [*s.running, *s.waiting, *s.swapped]


def test_parallel_sampling_shares_the_prompt_and_copies_on_write() -> None:
    s = _scheduler()
    parent = _add(s, "p", 6, max_tokens=3, n=3)  # 6 tokens: the second block is partly full
    _step(s)
    assert len(s.running) == 3
    shared = list(parent.block_table.blocks)
    assert all(q.block_table.blocks == shared for q in s.running)
    assert all(s.allocator.ref_count(b) == 3 for b in shared)
    out = s.schedule()
    assert len(out.copies) == 2  # two of the three copy the shared partial block
    assert {src for src, _ in out.copies} == {shared[1]}
    assert s.allocator.ref_count(shared[0]) == 3 and s.allocator.ref_count(shared[1]) == 1


def test_swap_preemption_moves_blocks_out_and_back() -> None:
    s = _scheduler(blocks=4, swap_blocks=8)
    old = _add(s, "old", 7, max_tokens=6)
    new = _add(s, "new", 7, max_tokens=6)
    swapped_out = swapped_in = 0
    while _unfinished(s):
        out = s.schedule()
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        record_step(
            s, out, [SampleOutput([7]) if i.samples else None for i in out.scheduled], [EOS]
        )
    assert swapped_out > 0 and swapped_in == swapped_out
    assert old.output_token_ids == new.output_token_ids == [7] * 6
    assert s.allocator.num_free_blocks == 4 and s.swap_allocator is not None
    assert s.swap_allocator.num_free_blocks == 8


def _check_invariants(s: Scheduler, seqs: list[Sequence], num_blocks: int) -> None:
    seqs = _all_seqs(s)
    held = [b for q in seqs for b in q.block_table.blocks]
    for block in set(held):
        assert s.allocator.ref_count(block) == held.count(block)  # ref counts = holders
    assert s.allocator.num_free_blocks + len(set(held)) == num_blocks  # none leaked
    if s.swap_allocator is not None:
        on_host = [b for q in seqs for b in q.swapped_blocks]
        assert len(on_host) == len(set(on_host))
        assert s.swap_allocator.num_free_blocks + len(on_host) == s.swap_allocator.num_blocks
    for q in s.running:
        assert q.block_table.capacity >= q.num_computed_tokens
        parent = None
        for index, block_hash in enumerate(q.block_table.block_hashes):
            size = q.block_table.block_size
            tokens = tuple(q.token_ids[index * size : (index + 1) * size])
            assert block_hash == chain_hash(parent, tokens)  # cached blocks match their hash
            parent = block_hash


OPS = st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 60))


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, max_size=40), st.booleans(), st.sampled_from([0, 6]))
def test_random_streams_keep_block_invariants(
    ops: list[tuple[str, int]], prefix_caching: bool, swap_blocks: int
) -> None:
    s = _scheduler(12, 4, 24, prefix_caching, swap_blocks)
    seqs: list[Sequence] = []
    rng = random.Random(0)
    for op, n in ops:
        if op == "add":  # prompts share prefixes (same first token), so the cache gets hits
            rid, n_samples = f"r{len(seqs)}", 1 + n % 3
            seqs.append(_add(s, rid, n % 30 + 1, n % 7 + 1, first=n % 2, n=n_samples))
        elif op == "step":
            _step(s)
        elif seqs:
            s.abort(rng.choice(seqs).request_id)
        _check_invariants(s, seqs, 12)
    while _unfinished(s):
        _step(s)
    assert s.allocator.num_free_blocks == 12


def test_a_sequence_its_pending_draw_ends_by_length_gets_no_further_step() -> None:
    """With async scheduling a step is planned before the last one's draws are read: a
    sequence whose pending draw reaches max_tokens, or max_model_len, is not scheduled again
    (that step's token would be thrown away); one with tokens left still is."""
    s = _scheduler(blocks=256, tokens=1024)
    done = _add(s, "one-token", 8, max_tokens=1)
    more = _add(s, "two-tokens", 8, max_tokens=2, first=20)
    full = _add(s, "at-the-limit", 511, max_tokens=100, first=40)  # max_model_len 512
    first = s.schedule()
    assert [item.seq for item in first.scheduled] == [done, more, full]
    s.advance(first)  # the draws are pending, not read back
    second = s.schedule()
    assert [item.seq for item in second.scheduled] == [more]
    s.advance(second)
    assert s.schedule().scheduled == []
    s.resolve(first, [SampleOutput([7])] * 3, [EOS])
    assert done.is_finished and full.is_finished and not more.is_finished
