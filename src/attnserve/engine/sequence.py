"""`Sequence`: one completion's state in the engine — tokens, progress, blocks, and how it ended.

A request with n > 1 (or best_of) starts as one sequence; when its prompt is computed, that
step draws one token per completion and the engine forks the sequence, the forks sharing the
prompt's blocks. A constrained sequence (structured outputs) carries its grammar matcher.
"""

from __future__ import annotations

import enum

from attnserve.core import TokenLogprobs
from attnserve.engine.block_table import BlockTable
from attnserve.engine.sequence_grammar import SequenceGrammar
from attnserve.sampling_params import SamplingParams

# Stands for a drawn token that is still on the device: with async scheduling, a step is
# scheduled while the previous step's draws are in flight (the model runner feeds them forward on
# the device); `resolve_pending` puts the real token in its place.
PENDING_TOKEN = -1


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
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_table = block_table
        self.token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_forks_pending = sampling_params.num_candidates - 1
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.swapped_blocks: list[int] = []
        self.grammar: SequenceGrammar | None = None  # structured outputs: set once compiled

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
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sample_seed(self) -> int | None:
        """The seed of this sequence's next draw, or None for the global generator."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        return hash((seed, self.index, self.num_output_tokens)) & (2**62 - 1)

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING_TOKEN

    def append_pending(self) -> None:
        """Hold the place of the token this step draws (see PENDING_TOKEN)."""
        self.token_ids.append(PENDING_TOKEN)

    def resolve_pending(
        self, token: int, logprob: float | None, top: TokenLogprobs | None = None
    ) -> None:
        """Put the drawn `token` in the pending token's place, with its log-probability and,
        where asked for, the top-k entries."""
        self.token_ids[-1] = token
        self._add_logprobs(logprob, top)

    def append(self, token: int, logprob: float | None, top: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token)
        self._add_logprobs(logprob, top)

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
        )
        child.num_forks_pending = 0
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.num_computed_tokens = self.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        child.append(token, logprob, top)
        return child

    def reset_for_recompute(self) -> None:
        """Preempted by recompute: drop the cache; every token will be prefilled again (and
        the prompt's log-probabilities computed again, if it had not finished)."""
        if not self.num_output_tokens:
            self.prompt_logprobs = []
        self.block_table.free()
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def finish(self, reason: str) -> None:
        self.block_table.free()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
