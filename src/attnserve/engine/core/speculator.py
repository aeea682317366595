"""`Speculator`: the engine's pace of speculative decoding — which running sequences draft after
each step, and how many of the drafts the ranks proposed each keeps.

While the batch is small (at most `disable_by_batch_size` sequences running), every running
sequence that is not paused drafts (`pace`: the plan's `draft_seq_ids`); the ranks' proposer
(`spec_decode`: prompt lookup or a draft model) sets up to `num_speculative_tokens` drafts of each
on its result, and the sequence keeps as many as fit (`take_drafts`). The scheduler then gives it
1 + K new tokens in the next step: its last token and the drafts, which the ranks verify in one
forward pass, sending back the drafts they accept and one token more. A draft model writes its
drafts' keys past the step, so the sequences that draft get blocks for those positions where
free (`num_lookahead_tokens`).
A sequence keeps no drafts while a draw of it is still on the device (async scheduling), while a
grammar constrains it (its mask would have to follow each draft), or where the drafts and the
token after them would run past `max_tokens` or `max_model_len`.

Speculation also steps aside where drafts fail (`DraftPace`): each sequence's drafts are scored
against the tokens that followed them, and a sequence whose recent drafts were nearly all wrong
gets none for a while (16 steps, doubling while it keeps failing, at most 256, each pause
ending on a multiple of 16 steps so that paused sequences are tried again together), then is
tried again for one round (wholly wrong drafts pause it again at once). The sequences' rounds
also pool their evidence: while the recent rounds of all sequences were nearly all wrong (a
moving average over rounds, each weighing 1/8), one wholly wrong round pauses a sequence at
once, so a draft that fails everyone costs each sequence one round, not four.

A step in which some sequence drafts runs synchronously; while none may draft, steps overlap
as without speculation, and a draft model computes only for the sequences that draft.
"""

from __future__ import annotations

import contextlib

from attnserve.config import SpeculativeConfig
from attnserve.engine.core.block_allocator import OutOfBlocksError
from attnserve.engine.core.scheduler import SchedulerOutput
from attnserve.engine.core.sequence import Sequence, SequenceStatus


class DraftPace:
    """One sequence's record of how its drafts fared: the share of each round's drafts that
    matched the tokens that followed (a moving average, halved each round), and the step from
    which it may draft again after failing (see the module docstring)."""

    __slots__ = ("acceptance", "drafts", "length", "pause", "resume_step")

    MIN_ACCEPTANCE = 0.1  # below this recent share of right drafts, a sequence pauses
    # a paused sequence's next round is a probe: if none of its drafts is right, it pauses again
    PROBE_ACCEPTANCE = 0.15
    FIRST_PAUSE, MAX_PAUSE = 16, 256  # steps

    def __init__(self) -> None:
        self.acceptance = 1.0
        self.pause = self.FIRST_PAUSE
        self.resume_step = 0
        self.drafts: list[int] = []  # the last round's drafts, after `length` tokens
        self.length = 0

    def may_draft(self, step: int) -> bool:
        return step >= self.resume_step

    def score(self, token_ids: list[int]) -> float | None:
        """The share of the last round's drafts that matched the tokens that followed them,
        once some did (drafts not verified, whose followers all match so far, count as
        right); None while none did. The round is then done with."""
        followed = token_ids[self.length : self.length + len(self.drafts)]
        if not self.drafts or not followed:
            return None
        right = next((i for i, t in enumerate(followed) if t != self.drafts[i]), len(followed))
        decided = right < len(followed) or right == len(self.drafts)  # else: right so far
        share = right / len(self.drafts) if decided else 1.0
        self.drafts = []
        return share

    def settle(self, share: float, step: int, all_failing: bool) -> None:
        """Take in a round's `share` of right drafts, scored after engine step `step`: pause
        if the recent share is too low, or if none was right while the rounds of all
        sequences fail (`all_failing`)."""
        self.acceptance = (self.acceptance + share) / 2
        if share >= 0.5:  # a good round: a later pause starts short again
            self.pause = self.FIRST_PAUSE
        if self.acceptance < self.MIN_ACCEPTANCE or (share == 0 and all_failing):
            # on a multiple of the first pause: the paused sequences' probes share their steps
            self.resume_step = -(-(step + self.pause) // self.FIRST_PAUSE) * self.FIRST_PAUSE
            self.pause = min(2 * self.pause, self.MAX_PAUSE)
            self.acceptance = self.PROBE_ACCEPTANCE

    def expect(self, drafts: list[int], length: int) -> None:
        """Remember this round's drafts, proposed after the first `length` tokens."""
        self.drafts, self.length = drafts, length


class Speculator:
    ROUND_WEIGHT = 1 / 8  # of one sequence's round in `recent_acceptance`

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # positions a draft model writes past a step (its drafts' keys)
        self.num_lookahead_tokens = (
            config.num_speculative_tokens if config.method == "draft_model" else 0
        )
        self._paces: dict[int, DraftPace] = {}  # seq id -> how its drafts fared
        self.recent_acceptance = 1.0  # of all sequences' rounds, each weighing ROUND_WEIGHT

    def drafting(self, running: list[Sequence], step: int) -> list[int]:
        """The running sequences that may draft after engine step `step`: none while the batch
        is large, else each but those paused (a new one may)."""
        if len(running) > self.config.disable_by_batch_size:
            return []
        paces = self._paces
        return [
            s.seq_id for s in running if s.seq_id not in paces or paces[s.seq_id].may_draft(step)
        ]

    def pace(self, out: SchedulerOutput, running: list[Sequence], step: int) -> bool:
        """Name the sequences that draft after scheduled step `out` (engine step `step`), with
        blocks for the positions a draft model writes past the step where free; whether any
        does."""
        out.draft_seq_ids = self.drafting(running, step)
        if self.num_lookahead_tokens and out.draft_seq_ids:
            drafting = set(out.draft_seq_ids)
            for item in out.scheduled:
                if item.samples and item.seq.seq_id in drafting:
                    end = item.seq.num_computed_tokens + item.num_new_tokens
                    with contextlib.suppress(OutOfBlocksError):  # the drafts stop where blocks do
                        item.seq.block_table.ensure_capacity(end + self.num_lookahead_tokens)
        return bool(out.draft_seq_ids)

    def take_drafts(self, running: list[Sequence], step: int) -> None:
        """Keep as many of each running sequence's proposed drafts as fit for the step after
        engine step `step` (none where it gets none), having scored its last drafts."""
        self._score(running, step)
        for seq in running:
            pace = self._paces[seq.seq_id]
            room = max(self._room(seq), 0) if pace.may_draft(step) else 0
            seq.spec_token_ids = seq.spec_token_ids[:room]
            pace.expect(seq.spec_token_ids, len(seq.token_ids))

    def _score(self, running: list[Sequence], step: int) -> None:
        """Score the running sequences' last rounds (keeping only their paces), fold them into
        `recent_acceptance`, then settle each pace."""
        paces, self._paces = self._paces, {}
        scored = []
        for seq in running:
            pace = self._paces[seq.seq_id] = paces.get(seq.seq_id) or DraftPace()
            share = pace.score(seq.token_ids)
            if share is not None:
                scored.append((pace, share))
                self.recent_acceptance += (share - self.recent_acceptance) * self.ROUND_WEIGHT
        all_failing = self.recent_acceptance < DraftPace.MIN_ACCEPTANCE
        for pace, share in scored:
            pace.settle(share, step, all_failing)

    def _room(self, seq: Sequence) -> int:
        """How many drafts `seq` may carry: 0 unless it decodes with all its tokens on the
        host and no grammar; else as many as leave room for the token drawn after them."""
        if seq.status is not SequenceStatus.RUNNING or seq.grammar is not None:
            return 0
        if seq.num_pending_tokens or seq.num_uncomputed_tokens != 1:
            return 0
        room = self.max_model_len - len(seq.token_ids) - 1
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        return room
