"""`SequenceState`: one sequence the worker holds, as the sampler and the verifier see it: its
fixed facts, and what its row of the persistent batch (`InputBatch`) says when asked (its
outputs, the seed and banned tokens of its next draws, its prompt log-probability targets).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from attnserve.step_types import NewSequence
from attnserve.worker.sampling_metadata import SamplingTable

SEED_MASK = 2**62 - 1


class BatchRows(Protocol):
    """What a sequence's state reads of the persistent batch (`InputBatch` has it)."""

    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_host_tokens: np.ndarray
    sampling_table: SamplingTable
    eos_token_ids: tuple[int, ...]


class SequenceState:
    """One held sequence's fixed facts, and what the sampler asks of its row (`SamplingRow`),
    read from the batch's arrays when asked."""

    __slots__ = ("_batch", "index", "num_prompt_tokens", "sampling", "slot")

    def __init__(self, batch: BatchRows, slot: int, seq: NewSequence) -> None:
        self._batch = batch
        self.slot = slot
        self.sampling = seq.sampling
        self.index = seq.index
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def num_samples(self) -> int:
        """Draws at the next sampling step: `num_first_draws` at the first, then 1."""
        return int(self._batch.sampling_table.num_samples[self.slot])

    @property
    def num_output_tokens(self) -> int:
        """Tokens past the prompt, drawn ones still on the device included."""
        return int(self._batch.num_tokens[self.slot]) - self.num_prompt_tokens

    @property
    def sample_seed(self) -> int | None:
        """The seed of this sequence's next draw, or None for the global generator."""
        return self.seed_ahead(0)

    def seed_ahead(self, ahead: int) -> int | None:
        """The seed of the draw `ahead` tokens after the next one (a verified draft's place):
        each output position has its own, so a seeded sequence draws the same tokens with
        speculation as without."""
        seed = self.sampling.seed if self.sampling is not None else None
        if seed is None:
            return None
        return hash((seed, self.index, self.num_output_tokens + ahead)) & SEED_MASK

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the next draw may not take: stop and EOS tokens before `min_tokens`."""
        return self.banned_ahead(0)

    def banned_ahead(self, ahead: int) -> tuple[int, ...]:
        """`banned_token_ids` of the draw `ahead` tokens after the next one."""
        params = self.sampling
        if params is None or not params.min_tokens:
            return ()
        if self.num_output_tokens + ahead >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self._batch.eos_token_ids
        return tuple(dict.fromkeys([*params.stop_token_ids, *eos]))

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._batch.token_ids[self.slot, : self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        """The outputs so far; every one must be on the host (penalties read them)."""
        known = int(self._batch.num_host_tokens[self.slot])
        if known < self._batch.num_tokens[self.slot]:
            raise RuntimeError("penalties need the outputs, but the last is still on the device")
        return self._batch.token_ids[self.slot, self.num_prompt_tokens : known].tolist()

    def prompt_logprob_targets(self, context: int, query: int) -> list[int]:
        """The next prompt token of each of this step's new tokens that has one (prompt
        log-probabilities), or [] when none are asked for."""
        params = self.sampling
        if params is None or params.prompt_logprobs is None or self.index:
            return []
        if self.num_output_tokens:
            return []
        end = min(context + query + 1, self.num_prompt_tokens)
        return self._batch.token_ids[self.slot, context + 1 : end].tolist()
