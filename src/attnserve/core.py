"""The step's data types, shared by the engine, the executors, the workers and the sampler: what
the engine hands the ranks each step (`ScheduledBatch` of `SequenceInput`s), what comes back
(`SampleOutput`s, through an `AsyncStepOutput`), and the one rule for what is a prefill.

A leaf below every package: it imports only `sampling_params`, so any layer may use it.

Per sequence: its new token ids, how many of its tokens are already cached, its block table, and
how to sample (None when the step ends inside a prompt chunk, so nothing is drawn); for the
draws of structured outputs, a token bitmask. Prefills come
first, decodes after, as the attention metadata builders require. Block moves (copy-on-write
copies, swaps to and from host memory) are done before the forward pass.

The per-sequence records (`SequenceInput`, `SampleOutput`) are built for every sequence every
step, so they are plain dataclasses, not frozen ones (whose `__init__` costs about three times
as much); nothing changes them once built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, overload

from attnserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

BlockPairs = list[tuple[int, int]]
TokenLogprobs = dict[int, float]  # token id -> log-probability


@overload
def is_prefill(query_len: int, context_len: int) -> bool: ...


@overload
def is_prefill(
    query_len: npt.NDArray[np.integer], context_len: npt.NDArray[np.integer]
) -> npt.NDArray[np.bool_]: ...


def is_prefill(query_len: Any, context_len: Any) -> Any:
    """Whether a sequence's step is a prefill: more than one new token, or nothing cached yet (a
    one-token prompt). Anything else is a decode. Works elementwise on numpy arrays."""
    return (query_len > 1) | (context_len == 0)


@dataclass
class SequenceInput:
    token_ids: list[int]
    context_len: int
    block_table: list[int]
    sampling: SamplingParams | None = None
    sample_seed: int | None = None  # for a seeded request: the seed of this step's first draw
    num_samples: int = 1  # independent draws from this row (a parallel-sampling fork)
    banned_token_ids: tuple[int, ...] = ()  # never drawn this step (EOS before min_tokens)
    prompt_token_ids: list[int] | None = None  # given when penalties apply
    output_token_ids: list[int] | None = None  # given when penalties apply
    prompt_logprob_targets: list[int] | None = None  # next prompt token of each new token
    num_prompt_logprobs: int = 0  # top-k alongside each target


@dataclass(frozen=True)
class TokenBitmask:
    """The tokens each constrained draw of a step may take (structured outputs), in xgrammar's
    layout: bit j of int32 word w of a row set = token 32 * w + j allowed. One row per
    constrained sequence, the same for all of its draws."""

    rows: list[int]  # the constrained sequences' positions among the step's sampling sequences
    bitmask: torch.Tensor  # [len(rows), ceil(vocab_size / 32)] int32, on the host


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[SequenceInput]
    blocks_to_swap_in: BlockPairs = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)
    blocks_to_copy: BlockPairs = field(default_factory=list)
    # (row, draw): the last new token of sequence `row` is still on the device, as the
    # `draw`-th token drawn by the previous step (async scheduling); its id here is a placeholder
    carried_tokens: BlockPairs = field(default_factory=list)
    token_bitmask: TokenBitmask | None = None  # where structured outputs constrain the draws

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampleOutput:
    """One sequence's result: a token per draw, its log-probability, and the top-k where asked
    for."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # per draw: the drawn token's and the top-k
    token_logprobs: list[float] | None = None  # per draw: the drawn token's log-probability
    prompt_logprobs: list[TokenLogprobs] | None = None  # per new prompt token with a target


StepResults = list[SampleOutput | None]  # per sequence of the batch; None where nothing drawn


class AsyncStepOutput(Protocol):
    """A launched step's results, read back when the engine asks (the worker's `StepFuture`)."""

    def result(self) -> StepResults:
        """Each sequence's draws, waiting for them if need be."""
        ...
