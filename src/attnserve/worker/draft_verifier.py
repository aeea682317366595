"""`DraftVerifier`: a verify step of speculative decoding — the drafts each sequence carried,
checked against the target model in the step's one forward pass, and the tokens it keeps.

A sequence with K drafts computed K + 1 new tokens: its last token and the drafts. The logits
at those K + 1 positions are sampled as K + 1 ordinary draws (`DraftPosition` rows: the draw at
position j sees the drafts before it as outputs, for penalties and `min_tokens`, and has the
seed of that output position), with every sampling feature of the sampler. Drafts are
accepted while each equals the draw at its position; the first draw that differs (or the draw
after the last draft) is the step's new token. This is exact: for a proposal that is one token
(prompt lookup proposes each draft with certainty), the standard modified rejection scheme
accepts the draft with probability p(draft) and otherwise draws from p with the draft removed,
renormalised — which is a draw from p that keeps the draft exactly when it equals it. So the
output is distributed as without speculation, greedy output is identical, and a seeded request
draws the same tokens as it would without speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from itertools import accumulate

import torch

from attnserve.host_copy import device_tensor
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput, StepResults, TokenBitmask
from attnserve.worker.input_batch import InputBatch, PreparedStep
from attnserve.worker.sampler import Sampler, SamplingRow
from attnserve.worker.sampling_metadata import SamplingMetadata
from attnserve.worker.sequence_state import SequenceState


class DraftPosition:
    """The draw at one position of a sequence's verify query: `ahead` drafts after its last
    token (a `SamplingRow`)."""

    __slots__ = ("ahead", "drafts", "state")

    def __init__(self, state: SequenceState, drafts: list[int], ahead: int) -> None:
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


def num_accepted(drawn: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the draws at their positions."""
    pairs = zip(drafts, drawn[: len(drafts)], strict=True)
    return next((i for i, (draft, token) in enumerate(pairs) if draft != token), len(drafts))


class DraftVerifier:
    """`sampling_threads`: a context for the sampler's ops (the model runner's: one thread on
    the CPU), which the LM head's product is kept out of (it wants every thread)."""

    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        sampler: Sampler,
        input_batch: InputBatch,
        sampling_threads: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        self.compute_logits = compute_logits
        self.sampler = sampler
        self.input_batch = input_batch
        self.sampling_threads = sampling_threads

    def verify(
        self, step: PreparedStep, hidden: torch.Tensor, token_bitmask: TokenBitmask | None
    ) -> StepResults:
        """Each sequence's results (see the module docstring), the batch brought up to date.
        `hidden` holds the step's new tokens in order (sequence i's end at the running sum of
        `step.num_new_tokens`), however the step's layout grouped them."""
        ends: list[int] = step.num_new_tokens.cumsum().tolist()
        rows, drafts = step.sample_rows, step.drafts or [[] for _ in step.states]
        inputs: list[SamplingRow] = []
        spans = []
        for row, state in zip(rows, step.sampling, strict=True):
            row_drafts = drafts[row]
            spans.append(1 + len(row_drafts))
            if row_drafts:
                inputs += [DraftPosition(state, row_drafts, j) for j in range(spans[-1])]
            else:
                inputs.append(state)
        offsets = [0, *accumulate(spans)]
        index = [
            ends[r] - span + j for r, span in zip(rows, spans, strict=True) for j in range(span)
        ]
        logits = self.compute_logits(hidden[device_tensor(index, hidden.device)])
        if token_bitmask is not None:  # constrained rows carry no drafts: one input each
            rows_at = [offsets[r] for r in token_bitmask.rows]
            token_bitmask = TokenBitmask(rows_at, token_bitmask.bitmask)
        metadata = SamplingMetadata.from_rows(inputs, hidden.device)
        with self.sampling_threads():
            draw = self.sampler.draw(logits, inputs, metadata, token_bitmask)
        drawn = self.sampler.split(
            draw.tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts
        )
        results: StepResults = [None] * len(step.states)
        for k, row in enumerate(rows):
            results[row] = _kept(drawn[offsets[k] : offsets[k + 1]], drafts[row])
        self.input_batch.accept_results(step, results)
        return results


def _kept(drawn: list[SampleOutput], drafts: list[int]) -> SampleOutput:
    """A row's result from its inputs' draws: a row without drafts as drawn; else the drafts
    accepted and the draw after them, with their log-probabilities."""
    if not drafts:
        return drawn[0]
    tokens = [out.token_ids[0] for out in drawn]
    keep = num_accepted(tokens, drafts) + 1
    logprobs = [out.logprobs[0] for out in drawn[:keep] if out.logprobs is not None]
    token_logprobs = [out.token_logprobs[0] for out in drawn[:keep] if out.token_logprobs]
    return SampleOutput(tokens[:keep], logprobs or None, token_logprobs or None)
