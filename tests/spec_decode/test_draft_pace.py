"""`DraftPace`: a sequence whose drafts keep failing stops drafting for a while, longer each
time it fails again (sequences paused apart resume together), and drafts as before once they
are right again."""

from __future__ import annotations

from attnserve.engine.core.speculator import DraftPace

PROMPT = [1, 2, 3, 4]


def fail_rounds(pace: DraftPace, tokens: list[int], step: int, rounds: int) -> int:
    """`rounds` rounds of three drafts of which none is right; the step after the last."""
    for _ in range(rounds):
        pace.expect([0, 0, 0], len(tokens))
        tokens.append(9)
        step += 1
        pace.observe(tokens, step)
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
    pace.observe(tokens, step)
    assert pace.may_draft(step + 1)


def test_right_drafts_keep_a_sequence_drafting_and_reset_its_pause() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    for step in range(1, 50):
        pace.expect([5, 6, 7], len(tokens))
        tokens += [5, 6, 8]  # two of three right, then the token drawn instead of the third
        pace.observe(tokens, step)
        assert pace.may_draft(step)
    step = fail_rounds(pace, tokens, 50, 3)  # 2/3 -> 1/3 -> 1/6 -> 1/12: paused
    step = resumes_at(pace, step, DraftPace.FIRST_PAUSE)
    pace.expect([5, 6, 7], len(tokens))
    tokens += [5, 6, 7, 1]
    pace.observe(tokens, step)
    assert pace.pause == DraftPace.FIRST_PAUSE  # a good round: the next pause is short again


def test_drafts_are_scored_once_tokens_followed_them() -> None:
    pace, tokens = DraftPace(), list(PROMPT)
    pace.expect([0, 0, 0], len(tokens))
    for step in range(1, 10):  # the sequence did not advance: nothing to score
        pace.observe(tokens, step)
    assert pace.acceptance == 1.0
    tokens.append(0)  # the first draft was right, and only one token followed so far
    pace.observe(tokens, 10)
    assert pace.acceptance == 1.0
