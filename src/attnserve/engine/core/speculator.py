"""`Speculator`: the draft tokens of the running sequences between steps (speculative decoding),
and `SpecDecodeStats`, the counts behind its metrics.

After a step's tokens are read back, and while the batch is small (at most
`disable_by_batch_size` sequences running), every running sequence that decodes gets up to
`num_speculative_tokens` drafts from its own tokens (prompt lookup: `NgramProposer`), or keeps
those the ranks' draft model proposed with the step's results (method "draft_model"), as many
as fit. The scheduler then gives it 1 + K new tokens in the next step: its last token and the
drafts, which the ranks verify in one forward pass, sending back the drafts they accept and one
token more.
A sequence gets no drafts while a draw of it is still on the device (async scheduling), while a
grammar constrains it (its mask would have to follow each draft), or where the drafts and the
token after them would run past `max_tokens` or `max_model_len`. Each sequence's tokens are
mirrored in a growing numpy array, extended with the new tokens only, so a lookup does not
convert the whole history every step.

Speculation also steps aside where drafts fail (`DraftPace`): each sequence's drafts are scored
against the tokens that followed them, and a sequence whose recent drafts were nearly all wrong
gets none for a while (16 steps, doubling while it keeps failing, at most 256, each pause
ending on a multiple of 16 steps so that paused sequences are tried again together), then is
tried again for one round (wholly wrong drafts pause it again at once). The sequences' rounds
also pool their evidence: while the recent rounds of all sequences were nearly all wrong (a
moving average over rounds, each weighing 1/8), one wholly wrong round pauses a sequence at
once, so a draft that fails everyone costs each sequence one round, not four.

A step in which some sequence drafts runs synchronously; while none may draft, steps overlap
as without speculation, a draft model is not asked to propose at all, and it computes only for
the sequences that draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnserve.config import SpeculativeConfig
from attnserve.engine.core.sequence import Sequence, SequenceStatus
from attnserve.spec_decode.ngram_proposer import NgramProposer

SPEC_DECODE_COUNTS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def spec_decode_stats(
    num_drafts: float, num_draft_tokens: float, num_accepted_tokens: float
) -> dict[str, float]:
    """The counts under their `SPEC_DECODE_COUNTS` names, the share of draft tokens accepted,
    and the mean number of tokens a verified sequence gained per step (the accepted drafts and
    the token drawn after them)."""
    values = (num_drafts, num_draft_tokens, num_accepted_tokens)
    counts = dict(zip(SPEC_DECODE_COUNTS, values, strict=True))
    return counts | {
        "spec_decode_acceptance_rate": num_accepted_tokens / max(num_draft_tokens, 1),
        "spec_decode_mean_acceptance_length": (
            1 + num_accepted_tokens / num_drafts if num_drafts else 0.0
        ),
    }


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (or `reset_stats`): verify steps of one sequence with
    drafts (`num_drafts`), the draft tokens they carried and the ones accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def as_dict(self) -> dict[str, float]:
        return spec_decode_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)


class _History:
    """A sequence's tokens as a numpy array that grows by doubling."""

    __slots__ = ("length", "tokens")

    def __init__(self) -> None:
        self.tokens = np.zeros(256, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """The array view of `token_ids`, of which the first `length` are held already."""
        end = len(token_ids)
        if end > len(self.tokens):
            grown = np.zeros(max(end, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        if end > self.length:
            self.tokens[self.length : end] = token_ids[self.length :]
        self.length = end
        return self.tokens[:end]


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
        self.proposer = (  # None: a draft model on the ranks proposes
            NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if config.method == "ngram"
            else None
        )
        self._histories: dict[int, _History] = {}  # seq id -> its tokens
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

    def propose(self, running: list[Sequence], step: int) -> None:
        """Set each running sequence's drafts for the step after engine step `step` (none where
        it gets none), having scored its last drafts."""
        histories, self._histories = self._histories, {}
        self._score(running, step)
        for seq in running:
            pace = self._paces[seq.seq_id]
            room = max(self._room(seq), 0) if pace.may_draft(step) else 0
            if self.proposer is None:  # the draft model's, from the step's results
                seq.spec_token_ids = seq.spec_token_ids[:room]
            elif room < 1:
                seq.spec_token_ids = []
            else:
                history = self._histories[seq.seq_id] = histories.get(seq.seq_id) or _History()
                seq.spec_token_ids = self.proposer.propose(history.sync(seq.token_ids), room)
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
