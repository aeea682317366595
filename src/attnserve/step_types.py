"""The step's data types, shared by the engine, the executors, the workers and the sampler: the
one `StepPlan` the engine hands the ranks each step, and what comes back (a `SampleOutput` per
sequence, through an `AsyncStepOutput`), and the one rule for what is a prefill. A step with
constrained draws may also be launched in two parts (`LaunchedForward`): its forward pass, then,
once the engine has its token bitmask, its draws.

A leaf below every package: it imports only `sampling_params`, so any layer may use it.

A plan carries only what changed since the last one: the sequences the ranks do not hold yet
(`NewSequence`: their tokens, blocks and how to sample), the blocks appended to (or replaced in)
the tables of the ones they hold, the ones they may drop, and how many new tokens each scheduled
sequence computes. The ranks keep everything else themselves (a persistent batch): token ids,
block tables, progress, sampling state, and the tokens they drew. Prefills come first, decodes
after, as the attention metadata builders require. Block moves (copy-on-write copies, swaps to
and from host memory) are done before the forward pass.
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


class AdapterRef(Protocol):
    """The LoRA adapter a sequence runs with (a `LoRARequest`: the LoRA package lies above)."""

    @property
    def lora_name(self) -> str: ...

    @property
    def lora_int_id(self) -> int: ...

    @property
    def lora_path(self) -> str: ...


@dataclass
class NewSequence:
    """A sequence the ranks do not hold (new, or back after a preemption): everything they keep
    of it. A step samples a sequence when it computes up to its last token; a sequence without
    `sampling` never samples (start-up runs, hidden-state probes)."""

    seq_id: int
    token_ids: list[int]  # every token known: the prompt, then the outputs so far
    num_prompt_tokens: int
    num_computed_tokens: int  # already in the cache (a cached prefix, swapped-in blocks)
    block_ids: list[int]  # of KV-cache group 0
    sampling: SamplingParams | None = None
    index: int = 0  # the completion's index in its request (seeded draws depend on it)
    num_first_draws: int = 1  # draws at its next sampling step (parallel-sampling forks)
    # of groups 1.. (as long as block_ids); none: every group uses block_ids (start-up runs)
    group_block_ids: list[list[int]] = field(default_factory=list)
    lora_request: AdapterRef | None = None  # its LoRA adapter (None: the base model)


@dataclass(frozen=True)
class BlockUpdate:
    """A held sequence's new block table: its first `num_kept` blocks, then `appended` (in
    KV-cache group 0; in groups 1.., `group_appended`)."""

    seq_id: int
    num_kept: int
    appended: list[int]
    group_appended: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class TokenBitmask:
    """The tokens each constrained draw of a step may take (structured outputs), in xgrammar's
    layout: bit j of int32 word w of a row set = token 32 * w + j allowed. One row per
    constrained sequence, the same for all of its draws."""

    rows: list[int]  # the constrained sequences' positions among the step's sampling sequences
    bitmask: torch.Tensor  # [len(rows), ceil(vocab_size / 32)] int32, on the host


@dataclass(frozen=True)
class StepPlan:
    """One step: the scheduled sequences (prefills first) and their new-token counts, and what
    the ranks must apply first — released sequences, then new ones, then block updates. A
    sequence with draft tokens computes its own next token and the drafts after it; the ranks
    send back the drafts they accept and one token drawn after them."""

    seq_ids: list[int]
    num_new_tokens: list[int]
    new_seqs: list[NewSequence] = field(default_factory=list)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)  # finished, aborted, preempted
    blocks_to_swap_in: BlockPairs = field(default_factory=list)
    blocks_to_swap_out: BlockPairs = field(default_factory=list)
    blocks_to_copy: BlockPairs = field(default_factory=list)
    # where structured outputs constrain the draws (None in a plan whose forward pass is
    # launched first: its bitmask is handed to the `LaunchedForward`)
    token_bitmask: TokenBitmask | None = None
    # speculative decoding: seq id -> the draft tokens ending its new tokens (to verify)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # a draft model proposes the next step's drafts for these sequences after this step
    draft_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @classmethod
    def of_new(cls, seqs: list[NewSequence]) -> StepPlan:
        """A step over sequences the ranks do not hold, each computing every token it does not
        have cached (start-up runs, benchmarks)."""
        return cls(
            [s.seq_id for s in seqs],
            [len(s.token_ids) - s.num_computed_tokens for s in seqs],
            new_seqs=seqs,
        )


@dataclass
class SampleOutput:
    """One sequence's result: a token per draw, its log-probability, and the top-k where asked
    for. For a sequence that carried drafts: the drafts accepted, then the token drawn after
    them (in the sequence's order, one draw)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # per draw: the drawn token's and the top-k
    token_logprobs: list[float] | None = None  # per draw: the drawn token's log-probability
    prompt_logprobs: list[TokenLogprobs] | None = None  # per new prompt token with a target
    draft_token_ids: list[int] | None = None  # a draft model's proposals for the next step


StepResults = list[SampleOutput | None]  # per sequence of the plan; None where nothing drawn


class AsyncStepOutput(Protocol):
    """A launched step's results, read back when the engine asks (the worker's `StepFuture`)."""

    def result(self) -> StepResults:
        """Each sequence's draws, waiting for them if need be."""
        ...


class LaunchedForward(Protocol):
    """A step launched without its token bitmask (structured outputs), its draws not yet: the
    engine computes the bitmask while the device runs the forward pass, then hands it over."""

    def sample(self, token_bitmask: TokenBitmask | None) -> AsyncStepOutput:
        """Launch the step's draws under `token_bitmask` (None: no constrained draw); once."""
        ...
