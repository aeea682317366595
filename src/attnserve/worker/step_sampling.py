"""The second half of a step on one rank (`StepSampling`): from the forward pass's final hidden
states to the step's draws (`sample`, giving `StepDraws`), then their one commit into the batch
(`commit`); and `ForwardPass`, a step between its two halves.

`ModelRunner.launch_forward` launches a step's forward pass and hands back a `ForwardPass`
(a `LaunchedForward`); its `sample` takes the step's token bitmask (structured outputs) and
launches the draws, which come back as a `StepFuture`. So the engine fills a step's bitmask on
the host while the device runs the step's forward pass (the bitmask follows the previous step's
tokens, read back meanwhile), and the device waits for the host only for what is left of that
work when the forward pass ends. A step is sampled once; until then the runner launches no other
step (the batch counts a step's tokens, `InputBatch.commit`, only once it is sampled).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate

import torch

from attnserve.host_copy import device_tensor
from attnserve.profiling import SAMPLING_RANGE, marked
from attnserve.spec_decode.verifier import VerifyRows
from attnserve.step_types import StepResults, TokenBitmask
from attnserve.worker.input_batch import InputBatch, PreparedStep
from attnserve.worker.prompt_logprobs import add_prompt_logprobs
from attnserve.worker.sampler import Sampler
from attnserve.worker.sampling_metadata import SamplingMetadata
from attnserve.worker.step_future import StepFuture


@contextlib.contextmanager
def sampling_threads(device: torch.device) -> Iterator[None]:
    """On the CPU, the sampler's ops on one thread: splitting a [rows, vocab] reduction over
    torch's OpenMP threads gains little and, where another process holds a core, waits for the
    descheduled thread at every op (milliseconds a step instead of tens of microseconds)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def last_hidden(hidden: torch.Tensor, step: PreparedStep) -> torch.Tensor:
    """The hidden states of the last new token of each sampling row."""
    if len(step.sample_rows) == len(hidden):  # one token per sequence, each sampling
        return hidden
    return hidden[step.sample_tokens]


@dataclass(frozen=True)
class StepDraws:
    """A sampled step's draws, not yet taken into the batch: each sampling row's first draw on
    the device (None where the results give them), and either the results on the host or the
    draws still on the device (the rows that drew, their tokens and log-probabilities)."""

    first_draws: torch.Tensor | None
    results: StepResults | None = None
    on_device: tuple[list[int], torch.Tensor, torch.Tensor] | None = None


class StepSampling:
    """How this rank turns a step's final hidden states into its draws: logits of the sampling
    rows, the sampler (on `sampling_threads`), drafts verified where the step carries them,
    prompt log-probabilities (`sample`); then the batch brought up to date (`commit`). It holds
    nothing of the model runner that holds it (no cycle: the engine freezes the garbage
    collector's objects)."""

    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        sampler: Sampler,
        input_batch: InputBatch,
        device: torch.device,
    ) -> None:
        self.compute_logits = compute_logits
        self.sampler = sampler
        self.input_batch = input_batch
        self.sampling_threads = functools.partial(sampling_threads, device)

    def sample(
        self, step: PreparedStep, hidden: torch.Tensor, token_bitmask: TokenBitmask | None
    ) -> StepDraws:
        """The step's draws (drafts verified where it carries them, prompt log-probabilities
        added), the batch left as it is (`commit` takes them in). Where one token each is
        drawn and nothing more is asked of them, they stay on the device."""
        rows = step.sample_rows
        if not rows:
            return StepDraws(
                None, self._with_prompt_logprobs(step, hidden, [None] * len(step.states))
            )
        if step.drafts is not None:
            verified = self._verify(step, step.drafts, hidden, token_bitmask)
            return StepDraws(None, self._with_prompt_logprobs(step, hidden, verified))
        logits = self.compute_logits(last_hidden(hidden, step))
        with marked(SAMPLING_RANGE), self.sampling_threads():
            draw = self.sampler.draw(logits, step.sampling, step.sampling_metadata, token_bitmask)
        tokens = draw.tokens
        one_draw_each = len(tokens) == len(rows)
        firsts = tokens if one_draw_each else tokens[self._first_draws(draw.counts, tokens)]
        if one_draw_each and draw.top is None and not self.input_batch.prompt_logprob_seqs:
            return StepDraws(firsts, on_device=(rows, tokens, draw.token_logprobs))
        results: StepResults = [None] * len(step.states)
        drawn = self.sampler.split(
            tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts
        )
        for row, result in zip(rows, drawn, strict=True):
            results[row] = result
        return StepDraws(firsts, self._with_prompt_logprobs(step, hidden, results))

    def commit(self, step: PreparedStep, draws: StepDraws) -> StepFuture:
        """Take the sampled step into the batch, once (`InputBatch.commit`); its results, or a
        future of draws still on the device, which writes them on the host when it reads them
        (`InputBatch.record`)."""
        pending = self.input_batch.commit(step, draws.first_draws, draws.results)
        if draws.results is not None:
            return StepFuture(len(step.states), ready=draws.results)
        record = functools.partial(self.input_batch.record, pending)
        return StepFuture(len(step.states), draws.on_device, on_tokens=record)

    def _verify(
        self,
        step: PreparedStep,
        drafts: list[list[int]],
        hidden: torch.Tensor,
        token_bitmask: TokenBitmask | None,
    ) -> StepResults:
        """A verify step's results (`spec_decode.verifier`): the drafts each row keeps and the
        token after them. `hidden` holds the step's new tokens in order (sequence i's end at
        the running sum of `step.num_new_tokens`), however the step's layout grouped them."""
        rows = step.sample_rows
        ends: list[int] = step.num_new_tokens.cumsum()[rows].tolist()
        verify = VerifyRows.of(step.sampling, [drafts[row] for row in rows], ends)
        logits = self.compute_logits(hidden[device_tensor(verify.logit_index, hidden.device)])
        metadata = SamplingMetadata.from_rows(verify.inputs, hidden.device)
        with self.sampling_threads():
            draw = self.sampler.draw(logits, verify.inputs, metadata, verify.bitmask(token_bitmask))
        drawn = self.sampler.split(
            draw.tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts
        )
        results: StepResults = [None] * len(step.states)
        for row, result in zip(rows, verify.kept(drawn), strict=True):
            results[row] = result
        return results

    @staticmethod
    def _first_draws(counts: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """Where each row's first draw lies among `tokens` (each row's draws in a run)."""
        return device_tensor([0, *accumulate(counts)][:-1], tokens.device)

    def _with_prompt_logprobs(
        self, step: PreparedStep, hidden: torch.Tensor, results: StepResults
    ) -> StepResults:
        """`results`, with prompt log-probabilities where sequences ask for them."""
        if self.input_batch.prompt_logprob_seqs:
            starts: list[int] = step.layout.query_start_loc.tolist()
            add_prompt_logprobs(self.compute_logits, step, hidden, starts, results)
        return results


class ForwardPass:
    """A step whose forward pass is launched and whose draws are not (a `LaunchedForward`)."""

    def __init__(self, sampling: StepSampling, step: PreparedStep, hidden: torch.Tensor) -> None:
        self._sampling = sampling
        self._step = step
        self._hidden: torch.Tensor | None = hidden

    @property
    def sampled(self) -> bool:
        """Whether `sample` has been called."""
        return self._hidden is None

    @torch.inference_mode()
    def sample(self, token_bitmask: TokenBitmask | None) -> StepFuture:
        """Launch the step's draws under `token_bitmask` (its rows: positions among the step's
        sampling sequences; None where none is constrained)."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            raise RuntimeError("this step's draws were launched already")
        draws = self._sampling.sample(self._step, hidden, token_bitmask)
        return self._sampling.commit(self._step, draws)
