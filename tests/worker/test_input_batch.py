"""`InputBatch`: the worker's persistent batch. Each step's layout and token ids must equal what
the plain `build_step_layout` gives for the same sequences spelled out in full; tokens drawn by a
step reach the next one from the device before the host knows them; a late result never lands
in a slot reused by another sequence; bad plans are refused by name."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention import StepLayout, build_step_layout
from attnserve.attention.backends.utils import int32_block_table
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import BlockUpdate, NewSequence, StepPlan
from attnserve.worker.graphs import pad_for_graph
from attnserve.worker.input_batch import INITIAL_SLOTS, InputBatch
from attnserve.worker.sampling_metadata import SamplingMetadata
from tests.worker.rows import Row

GREEDY = SamplingParams(temperature=0)
BLOCK = 4


def _batch() -> InputBatch:
    return InputBatch(
        max_model_len=64, block_size=BLOCK, eos_token_ids=[2], device=torch.device("cpu")
    )


def _new(
    seq_id: int, tokens: list[int], computed: int, blocks: list[int], **kwargs: object
) -> NewSequence:
    return NewSequence(seq_id, tokens, len(tokens), computed, blocks, GREEDY, **kwargs)  # type: ignore[arg-type]


def _same_layout(got: StepLayout, tables: list[list[int]], ctx: list[int], qry: list[int]) -> None:
    want = build_step_layout(tables, ctx, qry, BLOCK)
    for name in ("query_start_loc", "context_lens", "seq_lens", "slot_mapping", "token_pos"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.num_prefills == want.num_prefills


def test_a_step_of_new_sequences_matches_the_spelled_out_layout() -> None:
    batch = _batch()
    plan = StepPlan.of_new([_new(7, [5, 6, 7, 8, 9], 0, [3, 1]), _new(9, [4, 4, 4], 2, [0])])
    batch.apply(plan)
    step = batch.prepare(plan)
    _same_layout(step.layout, [[3, 1], [0]], [0, 2], [5, 1])
    assert step.token_ids.tolist() == [5, 6, 7, 8, 9, 4]
    assert step.sample_rows == [0, 1] and step.carried is None


def test_a_drawn_token_feeds_the_next_step_from_the_device_until_it_is_read() -> None:
    batch = _batch()
    batch.apply(StepPlan.of_new([_new(1, [5, 6, 7], 0, [0])]))
    first = batch.prepare(StepPlan([1], [3]))
    pending = batch.advance(first, torch.tensor([42]))
    decode = StepPlan([1], [1])
    step = batch.prepare(decode)  # the draw is still on the device
    _same_layout(step.layout, [[0]], [3], [1])
    assert step.carried is not None
    index, values = step.carried
    assert index.tolist() == [0] and values.tolist() == [42]
    batch.advance(step, torch.tensor([43]))
    batch.record(pending, [42])
    assert batch.states[1].prompt_token_ids == [5, 6, 7]
    assert batch.token_ids[batch.states[1].slot, :4].tolist() == [5, 6, 7, 42]
    with pytest.raises(RuntimeError, match="still on the device"):
        batch.states[1].output_token_ids  # noqa: B018 (43 is not read yet)


def test_a_late_result_does_not_land_in_a_reused_slot() -> None:
    batch = _batch()
    batch.apply(StepPlan.of_new([_new(1, [5, 6], 0, [0])]))
    pending = batch.advance(batch.prepare(StepPlan([1], [2])), torch.tensor([9]))
    plan = StepPlan([2], [2], new_seqs=[_new(2, [3, 3], 0, [1])], released_seq_ids=[1])
    batch.apply(plan)
    assert batch.states[2].slot == pending.slots[0]  # the freed slot is taken again
    batch.record(pending, [9])
    assert batch.prepare(plan).token_ids.tolist() == [3, 3]
    assert int(batch.num_host_tokens[batch.states[2].slot]) == 2


def test_block_updates_keep_a_prefix_and_append() -> None:
    batch = _batch()
    batch.apply(StepPlan.of_new([_new(1, list(range(6)), 0, [4, 5])]))
    batch.advance(batch.prepare(StepPlan([1], [6])), None)
    update = StepPlan([1], [0], block_updates=[BlockUpdate(1, 1, [8, 9])])
    batch.apply(update)
    assert batch.block_table[batch.states[1].slot, :3].tolist() == [4, 8, 9]


def _held(batch: InputBatch, seq_id: int) -> list[int]:
    slot = batch.states[seq_id].slot
    assert batch.num_host_tokens[slot] == batch.num_tokens[slot]
    return batch.token_ids[slot, : int(batch.num_tokens[slot])].tolist()


def test_kept_tokens_are_appended_one_each_at_once_or_several_each() -> None:
    """A draft model's batch takes in the tokens the target kept (`DraftRows.append_kept`): one a
    sequence, several, or none; never past max_model_len."""
    batch = _batch()
    batch.apply(
        StepPlan.of_new([_new(1, [5, 6], 0, [0]), _new(2, [7], 0, [1]), _new(3, [8], 0, [2])])
    )
    batch.drafts.append_kept([1, 2, 3], [[9], None, [4]])
    assert [_held(batch, s) for s in (1, 2, 3)] == [[5, 6, 9], [7], [8, 4]]
    batch.drafts.append_kept([1, 3], [[1, 2], [3]])
    assert [_held(batch, s) for s in (1, 2, 3)] == [[5, 6, 9, 1, 2], [7], [8, 4, 3]]
    batch.drafts.append_kept([2], [[1] * 64])  # the most it holds: one past max_model_len
    with pytest.raises(ValueError, match="kept one more"):
        batch.drafts.append_kept([2, 3], [[1], [1]])
    with pytest.raises(ValueError, match="past max_model_len"):
        batch.drafts.append_kept([3], [[1] * 63])


def test_the_batch_grows_past_its_first_slots() -> None:
    batch = _batch()
    seqs = [_new(i, [i + 3, 1], 0, [i]) for i in range(INITIAL_SLOTS + 3)]
    plan = StepPlan.of_new(seqs)
    batch.apply(plan)
    step = batch.prepare(plan)
    assert step.token_ids.tolist() == [t for i in range(INITIAL_SLOTS + 3) for t in (i + 3, 1)]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepPlan([5], [1]), "sequence 5 is not held"),
        (StepPlan([1], [4]), "computes tokens its sequences do not have"),
        (StepPlan([], [], new_seqs=[_new(1, [1], 0, [0])]), "already held"),
        (StepPlan([], [], new_seqs=[_new(3, [1, 2], 2, [0])]), "one left to compute"),
        (StepPlan([], [], new_seqs=[_new(4, [1], 0, list(range(17)))]), "17 blocks"),
        (StepPlan([], [], block_updates=[BlockUpdate(8, 0, [1])]), "sequence 8 is not held"),
    ],
    ids=["unknown", "too-many-tokens", "twice", "all-computed", "too-many-blocks", "update"],
)
def test_bad_plans_are_refused_by_name(plan: StepPlan, message: str) -> None:
    batch = _batch()
    batch.apply(StepPlan.of_new([_new(1, [1, 2, 3], 0, [0])]))
    with pytest.raises(ValueError, match=message):
        batch.apply(plan)
        batch.prepare(plan)


def test_sampling_rows_follow_the_sequence() -> None:
    batch = _batch()
    params = SamplingParams(seed=11, min_tokens=2, stop_token_ids=[5], prompt_logprobs=1)
    batch.apply(StepPlan.of_new([_new(1, [7, 8, 9], 0, [0], index=1)]))
    batch.states[1].sampling = params
    state = batch.states[1]
    assert state.banned_token_ids == (5, 2)  # the stop token, then EOS, before min_tokens
    seed = state.sample_seed
    assert seed == hash((11, 1, 0)) & (2**62 - 1)
    batch.advance(batch.prepare(StepPlan([1], [3])), torch.tensor([4]))
    assert state.sample_seed != seed and state.num_output_tokens == 1
    assert state.prompt_logprob_targets(0, 3) == []  # index 1: only the first completion


def _metadata_fields(metadata: SamplingMetadata) -> tuple[object, ...]:
    params = None if metadata.params is None else metadata.params.tolist()
    flags = (metadata.any_bias, metadata.any_penalties, metadata.any_min_tokens)
    flags += (metadata.any_seed, metadata.any_logprobs, metadata.any_filters)
    return params, metadata.num_samples.tolist(), flags


def test_sampling_parameters_are_gathered_from_the_persistent_table() -> None:
    """A step's sampling metadata, gathered from the slots' rows, is what the same parameters
    give spelled out (`from_rows`), whichever slots the sequences landed in; a fork's first
    draws count once, then one each."""
    batch = _batch()
    kinds = [
        SamplingParams(temperature=0.7, top_k=5, n=2),
        GREEDY,
        SamplingParams(top_p=0.5, seed=3, logprobs=1),
        SamplingParams(temperature=0, logit_bias={4: 1.0}, min_tokens=1),
        SamplingParams(min_p=0.1, repetition_penalty=1.2),
    ]
    filler = [_new(100 + i, [1, 2], 0, [0]) for i in range(INITIAL_SLOTS)]
    batch.apply(StepPlan.of_new(filler))  # the next sequences land in grown slots
    batch.release([100, 105])  # and in two freed ones
    seqs = [
        NewSequence(i, [3, 4, 5], 3, 0, [1], params, num_first_draws=params.n)
        for i, params in enumerate(kinds)
    ]
    plan = StepPlan.of_new(seqs[::-1])
    batch.apply(plan)
    step = batch.prepare(plan)
    rows = [Row(p, num_samples=p.n) for p in kinds[::-1]]
    assert _metadata_fields(step.sampling_metadata) == _metadata_fields(
        SamplingMetadata.from_rows(rows, "cpu")
    )
    batch.advance(step, torch.zeros(5, dtype=torch.int64))
    decode = batch.prepare(StepPlan([0, 1], [1, 1]))
    assert decode.sampling_metadata.num_samples.tolist() == [1, 1]
    greedy = batch.prepare(StepPlan([1], [1]))
    assert greedy.sampling_metadata.all_greedy and greedy.sampling_metadata.params is None


def test_block_tables_follow_appended_and_replaced_blocks_across_slot_reuse_and_growth() -> None:
    """After new sequences, appended and replaced blocks, a released slot reused and the slots
    grown, each step's block table (host int64, and the kernels' int32 copy) holds exactly each
    sequence's blocks; a padded graph step pads it with block 0."""
    batch = _batch()
    filler = [_new(100 + i, [1, 2, 3], 0, [i % 9, 5]) for i in range(INITIAL_SLOTS)]
    batch.apply(StepPlan.of_new(filler))
    plans = [
        StepPlan.of_new([_new(1, [5] * 6, 0, [3, 7]), _new(2, [4] * 9, 4, [8, 1, 6])]),
        StepPlan([1, 2], [1, 1], block_updates=[BlockUpdate(1, 1, [11, 12])]),
        StepPlan([3, 2], [2, 1], new_seqs=[_new(3, [9, 9], 0, [13])], released_seq_ids=[104]),
    ]
    expected = [[[3, 7], [8, 1, 6]], [[3, 11, 12], [8, 1, 6]], [[13], [8, 1, 6]]]
    for plan, tables in zip(plans, expected, strict=True):
        batch.apply(plan)
        step = batch.prepare(plan)
        batch.advance(step, torch.zeros(len(step.sample_rows), dtype=torch.int64))
        got = int32_block_table(step.layout, "cpu")
        assert got.dtype == torch.int32 and got.shape == (2, max(map(len, tables)))
        for row, table in zip(got.tolist(), tables, strict=True):
            assert row[: len(table)] == table
    decode = batch.prepare(StepPlan([1, 2], [1, 1])).layout
    padded = pad_for_graph(decode, 4)
    assert padded.block_table[:2].tolist() == decode.block_table.tolist()
    assert padded.block_table[2:].eq(0).all()
