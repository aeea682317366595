"""The verify step of speculative decoding: which draws check the drafts each sequence carried
(`VerifyRows`), and which tokens it keeps. The worker's `StepSampling` draws them with the
target's logits in the step's one forward pass.

A sequence with K drafts computed K + 1 new tokens: its last token and the drafts. The logits
at those K + 1 positions are sampled as K + 1 ordinary draws (`DraftPosition` rows: the draw at
position j sees the drafts before it as outputs, for penalties and `min_tokens`, and has the
seed of that output position), with every sampling feature of the sampler. Drafts are
accepted while each equals the draw at its position; the first draw that differs (or the draw
after the last draft) is the step's new token. This is exact: for a proposal that is one token
(prompt lookup and a greedy draft model propose each draft with certainty), the standard
modified rejection scheme accepts the draft with probability p(draft) and otherwise draws from p
with the draft removed, renormalised — which is a draw from p that keeps the draft exactly when
it equals it. So the output is distributed as without speculation, greedy output is identical,
and a seeded request draws the same tokens as it would without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Generic, Protocol, TypeVar

from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput, TokenBitmask


class AheadState(Protocol):
    """What a draw past a sequence's last token reads of it (the worker's `SequenceState`)."""

    @property
    def sampling(self) -> SamplingParams | None: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    def seed_ahead(self, ahead: int) -> int | None: ...

    def banned_ahead(self, ahead: int) -> tuple[int, ...]: ...


class DraftPosition:
    """The draw at one position of a sequence's verify query: `ahead` drafts after its last
    token (a sampler row)."""

    __slots__ = ("ahead", "drafts", "state")

    def __init__(self, state: AheadState, drafts: list[int], ahead: int) -> None:
        self.state = state
        self.drafts = drafts
        self.ahead = ahead

    @property
    def sampling(self) -> SamplingParams | None:
        return self.state.sampling

    @property
    def sample_seed(self) -> int | None:
        return self.state.seed_ahead(self.ahead)

    @property
    def num_samples(self) -> int:
        return 1

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        return self.state.banned_ahead(self.ahead)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.state.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.state.output_token_ids + self.drafts[: self.ahead]


State = TypeVar("State", bound=AheadState)


@dataclass(frozen=True)
class VerifyRows(Generic[State]):
    """A verify step's draws: for each sampling sequence, one at its last token and one after
    each of its drafts; a sequence without drafts draws as it would in any step."""

    inputs: list[State | DraftPosition]  # the sampler's rows
    logit_index: list[int]  # each row's token among the step's new tokens
    offsets: list[int]  # where each sequence's rows start, then the end
    drafts: list[list[int]]  # each sequence's drafts

    @classmethod
    def of(cls, states: list[State], drafts: list[list[int]], ends: list[int]) -> VerifyRows[State]:
        """The rows of sampling sequences `states`, with their `drafts`, whose new tokens end
        before `ends` among the step's new tokens (drafts last)."""
        inputs: list[State | DraftPosition] = []
        index: list[int] = []
        for state, row_drafts, end in zip(states, drafts, ends, strict=True):
            span = 1 + len(row_drafts)
            if row_drafts:
                inputs += [DraftPosition(state, row_drafts, j) for j in range(span)]
            else:
                inputs.append(state)
            index += range(end - span, end)
        offsets = [0, *accumulate(1 + len(row_drafts) for row_drafts in drafts)]
        return cls(inputs, index, offsets, drafts)

    def bitmask(self, token_bitmask: TokenBitmask | None) -> TokenBitmask | None:
        """The step's token bitmask over these rows (a constrained sequence carries no drafts:
        one row each)."""
        if token_bitmask is None:
            return None
        return TokenBitmask([self.offsets[r] for r in token_bitmask.rows], token_bitmask.bitmask)

    def kept(self, drawn: list[SampleOutput]) -> list[SampleOutput]:
        """Each sequence's result from its rows' draws (`drawn`, one per row)."""
        ranges = zip(self.offsets[:-1], self.offsets[1:], strict=True)
        return [
            _kept(drawn[start:end], row_drafts)
            for (start, end), row_drafts in zip(ranges, self.drafts, strict=True)
        ]


def num_accepted(drawn: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the draws at their positions."""
    pairs = zip(drafts, drawn[: len(drafts)], strict=True)
    return next((i for i, (draft, token) in enumerate(pairs) if draft != token), len(drafts))


def _kept(drawn: list[SampleOutput], drafts: list[int]) -> SampleOutput:
    """A sequence's result from its rows' draws: without drafts as drawn; else the drafts
    accepted and the draw after them, with their log-probabilities."""
    if not drafts:
        return drawn[0]
    tokens = [out.token_ids[0] for out in drawn]
    keep = num_accepted(tokens, drafts) + 1
    logprobs = [out.logprobs[0] for out in drawn[:keep] if out.logprobs is not None]
    token_logprobs = [out.token_logprobs[0] for out in drawn[:keep] if out.token_logprobs]
    return SampleOutput(tokens[:keep], logprobs or None, token_logprobs or None)
