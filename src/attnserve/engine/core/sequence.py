"""`Sequence`: one completion's state in the engine — tokens, progress, blocks, and how it ended.

A request with n > 1 (or best_of) starts as one sequence; when its prompt is computed, that
step draws one token per completion and the engine forks the sequence, the forks sharing the
prompt's blocks. A constrained sequence (structured outputs) carries its grammar matcher.

With async scheduling a step is scheduled while the previous step's draws are still on the
device (the ranks feed them forward there): `num_pending_tokens` counts the draws a sequence is
owed, and `resolve_pending` appends each when it arrives. Every sequence has a `seq_id` of its
own, by which the ranks know it.

With speculative decoding a sequence may carry draft tokens (`spec_token_ids`) into a step; the
step then appends the drafts it accepted and one drawn token (`num_step_tokens` in all).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable

from attnserve.engine.core.block_table import BlockTable
from attnserve.engine.core.sequence_grammar import SequenceGrammar
from attnserve.lora.request import LoRARequest
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput, TokenLogprobs

_seq_ids = itertools.count()
Draw = tuple[int, float | None, TokenLogprobs | None]  # a token, its log-probability, its top-k


def draws_of(result: SampleOutput) -> list[Draw]:
    """Each token of a result with its log-probability and top-k entries (None where none)."""
    tokens = result.token_ids
    chosen: list[float] | list[None] = result.token_logprobs or [None] * len(tokens)
    top: list[TokenLogprobs] | list[None] = result.logprobs or [None] * len(tokens)
    return list(zip(tokens, chosen, top, strict=True))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_table: BlockTable,
        index: int = 0,
        priority: int = 0,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.priority = priority  # lower runs earlier (the "priority" scheduling policy)
        self.arrival_order = self.seq_id  # its request's arrival among all (forks keep it)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_table = block_table
        self.token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # drawn by a launched step, not yet read back
        self.status = SequenceStatus.WAITING
        self.first_scheduled_at = 0.0  # time.monotonic() when a step first took it
        self.arrival_step = 0  # the scheduler's step count when it arrived ...
        self.queued_steps = 0  # ... and the steps it then waited before a step first took it
        self.finish_reason: str | None = None
        self.num_forks_pending = sampling_params.num_candidates - 1
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.swapped_blocks: list[int] = []
        self.grammar: SequenceGrammar | None = None  # structured outputs: set once compiled
        self.spec_token_ids: list[int] = []  # draft tokens for the next step (speculation)
        self.num_step_tokens = 0  # tokens the last step that drew for it appended
        self.step_cumulative_logprobs: list[float] = []  # after each of them
        self.lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Every token, the pending ones included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def resolve_pending(
        self, token: int, logprob: float | None, top: TokenLogprobs | None = None
    ) -> None:
        """Append a pending draw that has arrived: `token`, its log-probability and, where
        asked for, the top-k entries."""
        if not self.num_pending_tokens:
            raise RuntimeError(f"sequence {self.seq_id} has no pending draw")
        self.num_pending_tokens -= 1
        self.num_step_tokens = 1
        self.step_cumulative_logprobs = []
        self.append(token, logprob, top)

    def append(self, token: int, logprob: float | None, top: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token)
        self._add_logprobs(logprob, top)
        self.step_cumulative_logprobs.append(self.cumulative_logprob)

    def append_verified(
        self, draws: list[Draw], drafts: list[int], ended: Callable[[Sequence], bool]
    ) -> None:
        """A verify step's `draws`: the drafts the ranks accepted, then the token they drew,
        appended one at a time until one ends the sequence (`ended`). The accepted drafts are
        in the cache already."""
        accepted = len(draws) - 1
        if [token for token, _, _ in draws[:accepted]] != drafts[:accepted]:
            raise RuntimeError(
                f"sequence {self.seq_id}: the ranks accepted tokens it did not draft"
            )
        self.resolve_pending(*draws[0])
        for draw in draws[1:]:
            if ended(self):
                break
            self.append(*draw)
            self.num_step_tokens += 1
        self.num_computed_tokens += min(self.num_step_tokens, accepted)
        self.block_table.commit_computed(self.token_ids, self.num_computed_tokens)

    def _add_logprobs(self, logprob: float | None, top: TokenLogprobs | None) -> None:
        if logprob is not None:
            self.cumulative_logprob += logprob
        if top is not None:
            self.logprobs.append(top)

    def fork(
        self, index: int, token: int, logprob: float | None, top: TokenLogprobs | None = None
    ) -> Sequence:
        """A sibling that shares this sequence's computed blocks and continues with `token`."""
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.block_table.fork(),
            index,
            self.priority,
        )
        child.arrival_order = self.arrival_order
        child.lora_request = self.lora_request
        child.num_forks_pending = 0
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.num_computed_tokens = self.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        child.num_step_tokens = 1
        child.append(token, logprob, top)
        return child

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: drop the cache; every token will be prefilled again (and
        the prompt's log-probabilities computed again, if it had not finished)."""
        if not self.num_output_tokens:
            self.prompt_logprobs = []
        self.spec_token_ids = []
        self.block_table.free()
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def finish(self, reason: str) -> None:
        self.block_table.free()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
