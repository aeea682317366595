"""`DraftRows`: draft tokens in a rank's persistent batch — the bookkeeping speculative decoding
adds to the worker's `InputBatch`, which holds one and calls it.

In the target's batch: a verify step's drafts are written after each sequence's known tokens,
where the step's inputs are gathered from (they are not the sequence's tokens: `write`); the
step runs as decode rows, each sequence's query its last token and its drafts (`as_decode_rows`);
once verified, a sequence takes the drafts it accepted and the token drawn after them, and its
rejected drafts no longer count as computed (`take_verified`). In a draft model's batch: the
tokens the target kept are appended (`append_kept`), its catch-up passes of a few tokens a
sequence run as decode rows too (`as_decode_rows` with `decode_rows_up_to`), and its own drafts
are forgotten once proposed (`truncate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from attnserve.step_types import SampleOutput, StepPlan


class HeldRows(Protocol):
    """The arrays of a batch that draft tokens touch, a row (slot) per held sequence (the
    worker's `InputBatch`)."""

    token_ids: np.ndarray  # [slots, max_tokens]
    num_host_tokens: np.ndarray  # tokens known on the host
    num_tokens: np.ndarray  # tokens in all
    num_computed: np.ndarray  # tokens in the cache
    last_sampled: torch.Tensor  # each slot's last token, on the device
    max_tokens: int
    prompt_logprob_seqs: set[int]

    def slot_of(self, seq_id: int) -> int: ...


def num_drafts(drafts: list[list[int]]) -> np.ndarray:
    return np.fromiter(map(len, drafts), np.int64, len(drafts))


class DraftRows:
    def __init__(self, batch: HeldRows) -> None:
        self.batch = batch

    def write(self, plan: StepPlan, slots: np.ndarray) -> list[list[int]] | None:
        """Each sequence's draft tokens (None when the plan carries none), written after its
        known tokens."""
        if not plan.spec_token_ids:
            return None
        batch, drafts = self.batch, []
        for seq_id, slot in zip(plan.seq_ids, slots.tolist(), strict=True):
            tokens = plan.spec_token_ids.get(seq_id, [])
            start = int(batch.num_tokens[slot])
            if start + len(tokens) >= batch.max_tokens:
                raise ValueError(f"sequence {seq_id}: its drafts run past max_model_len")
            if tokens and start > batch.num_host_tokens[slot]:
                raise ValueError(f"sequence {seq_id}: drafts follow a token not on the host")
            batch.token_ids[slot, start : start + len(tokens)] = tokens
            drafts.append(tokens)
        return drafts

    def as_decode_rows(
        self,
        plan: StepPlan,
        context: np.ndarray,
        query: np.ndarray,
        drafts: list[list[int]] | None,
        decode_rows_up_to: int,
    ) -> bool:
        """Whether a step runs as decode rows: no prompt, no sequence asking for prompt
        log-probabilities (they read per-sequence rows), and either drafts to verify beside
        plain decodes or at most `decode_rows_up_to` new tokens a sequence, some more than one."""
        if not self.batch.prompt_logprob_seqs.isdisjoint(plan.seq_ids) or not (context > 0).all():
            return False
        if drafts is not None:
            return bool((query == num_drafts(drafts) + 1).all())
        return 1 < int(query.max(initial=0)) <= decode_rows_up_to

    def take_verified(
        self,
        slots: np.ndarray,
        drafts: list[list[int]],
        kept: Sequence[SampleOutput | None],
    ) -> None:
        """After a verify step's first draws are recorded: each sequence with drafts also takes
        the rest of what it kept (its accepted drafts past the first, and the token drawn after
        them); its rejected drafts are no longer computed."""
        batch = self.batch
        for slot, row_drafts, result in zip(slots.tolist(), drafts, kept, strict=True):
            if not row_drafts or result is None:
                continue
            tokens = result.token_ids[1:]
            start = int(batch.num_tokens[slot])
            batch.token_ids[slot, start : start + len(tokens)] = tokens
            batch.num_tokens[slot] = batch.num_host_tokens[slot] = start + len(tokens)
            batch.num_computed[slot] -= len(row_drafts) - len(tokens)
            if tokens:
                batch.last_sampled[slot] = tokens[-1]

    def append_kept(self, seq_ids: list[int], kept: list[list[int] | None]) -> None:
        """Take in the tokens each sequence kept that were computed elsewhere (a draft model's
        batch takes the target's; None: none), known on the host and not counted as computed
        here; a step where each kept one token is written at once."""
        rows = [(seq_id, tokens) for seq_id, tokens in zip(seq_ids, kept, strict=True) if tokens]
        if any(len(tokens) != 1 for _, tokens in rows):
            for seq_id, tokens in rows:
                self._append(seq_id, tokens)
            return
        batch = self.batch
        slots = np.fromiter((batch.slot_of(seq_id) for seq_id, _ in rows), np.int64, len(rows))
        positions = batch.num_tokens[slots]
        if len(rows) and int(positions.max()) >= batch.max_tokens:
            raise ValueError(f"a sequence of {batch.max_tokens} tokens kept one more")
        batch.token_ids[slots, positions] = [tokens[0] for _, tokens in rows]
        batch.num_tokens[slots] = batch.num_host_tokens[slots] = positions + 1

    def _append(self, seq_id: int, tokens: list[int]) -> None:
        batch = self.batch
        slot = batch.slot_of(seq_id)
        start = int(batch.num_tokens[slot])
        if start + len(tokens) > batch.max_tokens:
            raise ValueError(f"sequence {seq_id}: {start + len(tokens)} tokens, past max_model_len")
        batch.token_ids[slot, start : start + len(tokens)] = tokens
        batch.num_tokens[slot] = batch.num_host_tokens[slot] = start + len(tokens)

    def truncate(self, slots: np.ndarray, counts: np.ndarray) -> None:
        """Forget each slot's last `counts` tokens, computed and known (a draft model's own
        drafts, once proposed)."""
        batch = self.batch
        batch.num_tokens[slots] -= counts
        batch.num_host_tokens[slots] = batch.num_tokens[slots]
        batch.num_computed[slots] -= counts
