"""`DraftPace`: a sequence whose drafts keep failing stops drafting for a while, longer each
time it fails again (sequences paused apart resume together), and drafts as before once they
are right again; while every sequence's rounds fail (`Speculator`), one wholly wrong round
pauses a sequence."""

from __future__ import annotations

from attnserve.config import SpeculativeConfig
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.sequence import Sequence, SequenceStatus
from attnserve.engine.core.speculator import DraftPace, Speculator
from attnserve.sampling_params import SamplingParams

PROMPT = [1, 2, 3, 4]


def observe(pace: DraftPace, tokens: list[int], step: int, all_failing: bool = False) -> None:
    """Score the pace's last round against `tokens` and take the score in, if there is one."""
    share = pace.score(tokens)
    if share is not None:
        pace.settle(share, step, all_failing)


def fail_rounds(pace: DraftPace, tokens: list[int], step: int, rounds: int) -> int:
    """`rounds` rounds of three drafts of which none is right; the step after the last."""
    for _ in range(rounds):
        pace.expect([0, 0, 0], len(tokens))
        tokens.append(9)
        step += 1
        observe(pace, tokens, step)
    return step


def resumes_at(pace: DraftPace, step: int, pause: int) -> int:
    """The first step from which `pace`, paused at `step`, drafts again: at least `pause` steps
    later, on a multiple of the first pause."""
    resume = next(s for s in range(step, step + 2 * pause + 1) if pace.may_draft(s))
    assert resume >= step + pause
    assert resume % DraftPace.FIRST_PAUSE == 0
    return resume


def test_failing_drafts_pause_the_sequence_and_longer_each_time() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    step = fail_rounds(pace, tokens, 0, 3)
    assert pace.may_draft(step)  # 1.0 -> 0.5 -> 0.25 -> 0.125: still trying
    step = fail_rounds(pace, tokens, step, 1)
    assert not pace.may_draft(step)
    step = resumes_at(pace, step, DraftPace.FIRST_PAUSE)
    step = fail_rounds(pace, tokens, step, 1)  # a probe round: one failure pauses it again
    resumes_at(pace, step, 2 * DraftPace.FIRST_PAUSE)


def test_sequences_paused_at_different_steps_are_tried_again_together() -> None:
    first, second = DraftPace(), DraftPace()
    fail_rounds(first, list(PROMPT), 0, 4)
    fail_rounds(second, list(PROMPT), 9, 4)
    assert resumes_at(first, 4, 16) == resumes_at(second, 13, 16) == 32


def test_a_probe_round_with_a_right_draft_keeps_the_sequence_drafting() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    step = fail_rounds(pace, tokens, 0, 4)
    step = resumes_at(pace, step, DraftPace.FIRST_PAUSE)
    pace.expect([5, 6, 7], len(tokens))
    tokens += [5, 8]  # one of three right
    observe(pace, tokens, step)
    assert pace.may_draft(step + 1)


def test_right_drafts_keep_a_sequence_drafting_and_reset_its_pause() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    for step in range(1, 50):
        pace.expect([5, 6, 7], len(tokens))
        tokens += [5, 6, 8]  # two of three right, then the token drawn instead of the third
        observe(pace, tokens, step)
        assert pace.may_draft(step)
    step = fail_rounds(pace, tokens, 50, 3)  # 2/3 -> 1/3 -> 1/6 -> 1/12: paused
    step = resumes_at(pace, step, DraftPace.FIRST_PAUSE)
    pace.expect([5, 6, 7], len(tokens))
    tokens += [5, 6, 7, 1]
    observe(pace, tokens, step)
    assert pace.pause == DraftPace.FIRST_PAUSE  # a good round: the next pause is short again


def test_drafts_are_scored_once_tokens_followed_them() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    pace.expect([0, 0, 0], len(tokens))
    for step in range(1, 10):  # the sequence did not advance: nothing to score
        observe(pace, tokens, step)
    assert pace.acceptance == 1.0
    tokens.append(0)  # the first draft was right, and only one token followed so far
    observe(pace, tokens, 10)
    assert pace.acceptance == 1.0


def decoding_sequences(count: int) -> list[Sequence]:
    """`count` running sequences, each with its prompt computed but its last token."""
    sequences = []
    for _ in range(count):
        table = BlockTable(BlockAllocator(64), block_size=4)
        seq = Sequence("r", PROMPT, SamplingParams(max_tokens=64), table)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = len(seq.token_ids) - 1
        sequences.append(seq)
    return sequences


def draft_round(speculator: Speculator, sequences: list[Sequence], step: int, right: int) -> None:
    """Each sequence gets three drafts after step `step` (as a draft model proposes them), of
    which the first `right` are then drawn by the next step; the next round is scored."""
    drafts = [5, 6, 7]
    for seq in sequences:
        seq.spec_token_ids = list(drafts)
    speculator.take_drafts(sequences, step)
    for seq in sequences:
        seq.token_ids += [*drafts[:right], 9]
        seq.num_computed_tokens = len(seq.token_ids) - 1
    speculator.take_drafts(sequences, step + 1)


def draft_model_speculator() -> Speculator:
    return Speculator(SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 3}), 512)


def test_a_round_that_fails_every_sequence_pauses_them_all() -> None:
    speculator, sequences = draft_model_speculator(), decoding_sequences(24)
    draft_round(speculator, sequences, 0, right=0)
    assert speculator.recent_acceptance < DraftPace.MIN_ACCEPTANCE
    assert speculator.drafting(sequences, 2) == []
    step = next(s for s in range(2, 64) if speculator.drafting(sequences, s))
    assert step % DraftPace.FIRST_PAUSE == 0  # tried again together


def test_one_sequence_failing_alone_keeps_its_four_rounds() -> None:
    speculator, (alone,) = draft_model_speculator(), decoding_sequences(1)
    for step in range(0, 6, 2):
        draft_round(speculator, [alone], step, right=0)
        assert speculator.drafting([alone], step + 2) == [alone.seq_id]
    draft_round(speculator, [alone], 6, right=0)
    assert speculator.drafting([alone], 8) == []


def test_a_failing_round_among_right_ones_does_not_pause_at_once() -> None:
    speculator, sequences = draft_model_speculator(), decoding_sequences(16)
    draft_round(speculator, sequences[:15], 0, right=3)
    draft_round(speculator, sequences[15:], 2, right=0)
    assert speculator.drafting(sequences, 4) == [s.seq_id for s in sequences]
