"""What the engine hands the worker each step, and what it gets back: plain data, defined below
the engine so the worker never imports it.

Per sequence: its new token ids, how many of its tokens are already cached, its block table, and
how to sample (None when the step ends inside a prompt chunk, so nothing is drawn). Prefills come
first, decodes after, as the attention metadata builders require. Block moves (copy-on-write
copies, swaps to and from host memory) are done before the forward pass.

The per-sequence records (`SequenceInput`, `SampleOutput`) are built for every sequence every
step, so they are plain dataclasses, not frozen ones (whose `__init__` costs about three times
as much); nothing changes them once built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]


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

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or self.context_len == 0


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[SequenceInput]
    blocks_to_swap_in: BlockPairs = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)
    blocks_to_copy: BlockPairs = field(default_factory=list)
    # (row, draw): the last new token of sequence `row` is still on the device, as the
    # `draw`-th token drawn by the previous step (async scheduling); its id here is a placeholder
    carried_tokens: BlockPairs = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


TokenLogprobs = dict[int, float]


@dataclass
class SampleOutput:
    """One sequence's result: a token per draw, and log-probabilities where asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # per draw: the drawn token's and the top-k
    prompt_logprobs: list[TokenLogprobs] | None = None  # per new prompt token with a target
