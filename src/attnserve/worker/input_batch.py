"""`InputBatch`: the worker's persistent state of every sequence it holds, and each step's inputs
built from it.

The engine sends only what changed (`StepPlan`); this keeps the rest, one row (a slot) per held
sequence in persistent host arrays: its token ids, how many are known on the host and in all,
how many are in the cache, its block table, and its sampling parameters (`SamplingTable`). A
step's layout, token ids, sampling rows and `SamplingMetadata` come from those arrays with a few
vectorised gathers (no per-sequence lists), and the indices the device needs (the sampling rows'
slots and last tokens, where carried tokens go) cross in one transfer. The first token each
sequence draws stays on the device (`last_sampled`): the next step reads it from there (a token
the host does not know yet, with async scheduling), and the host copy is written when the step's
future resolves (`record`). Slots are reused; a slot's generation tells a late result that its
sequence has gone. Draft tokens (speculative decoding) are kept by its `DraftRows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnserve.attention import StepLayout, as_decode_rows, layout_from_arrays
from attnserve.host_copy import device_tensor, to_device
from attnserve.spec_decode.draft_rows import DraftRows, num_drafts
from attnserve.step_types import NewSequence, StepPlan, StepResults
from attnserve.worker.sampling_metadata import SamplingMetadata, SamplingTable
from attnserve.worker.sequence_state import SequenceState

INITIAL_SLOTS = 64


@dataclass(frozen=True)
class PreparedStep:
    """One step's inputs: the layout, the new token ids on the host, where tokens drawn by the
    previous step (still on the device) go among them, the rows that sample, and each row's
    draft tokens (speculative decoding: the last new tokens of its query; None when no
    sequence of the step has any)."""

    layout: StepLayout
    token_ids: torch.Tensor  # [T] int64, host; carried positions hold a placeholder
    carried: tuple[torch.Tensor, torch.Tensor] | None  # (flat token index, token) on the device
    slots: np.ndarray  # [B] each sequence's slot
    draw_slots: torch.Tensor  # [N] the sampling rows' slots, on the device
    sample_tokens: torch.Tensor  # [N] each sampling row's last new token (flat), on the device
    num_new_tokens: np.ndarray  # [B] each sequence's new tokens (the layout may regroup them)
    states: list[SequenceState]  # [B]
    sample_rows: list[int]  # the sequences that draw this step
    sampling: list[SequenceState]  # their states, in the same order
    sampling_metadata: SamplingMetadata  # their parameters
    drafts: list[list[int]] | None = None  # [B] each sequence's draft tokens


@dataclass(frozen=True)
class PendingDraws:
    """Where a launched step's first draws go in the host token arrays once they are read."""

    slots: np.ndarray
    positions: np.ndarray
    generations: np.ndarray


class InputBatch:
    def __init__(
        self,
        max_model_len: int,
        block_size: int,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.max_tokens = max_model_len + 1  # a step may draw past the limit; then it ends
        self.max_blocks = -(-max_model_len // block_size)
        self.states: dict[int, SequenceState] = {}  # seq id -> state
        self.prompt_logprob_seqs: set[int] = set()  # held sequences that ask for them
        self.drafts = DraftRows(self)
        self._free_slots: list[int] = []
        self.token_ids = np.zeros((0, self.max_tokens), dtype=np.int64)
        self.num_host_tokens = np.zeros(0, dtype=np.int64)  # known on the host
        self.num_tokens = np.zeros(0, dtype=np.int64)  # in all, drawn ones on the device too
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.num_groups = 1  # KV-cache groups: a block table each
        self.block_tables = np.zeros((0, 1, self.max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(0, dtype=np.int64)
        self.generation = np.zeros(0, dtype=np.int64)
        self.samples = np.zeros(0, dtype=np.bool_)  # has sampling params
        self.last_sampled = torch.zeros(0, dtype=torch.int64, device=device)
        self.sampling_table = SamplingTable(0)
        self._grow(INITIAL_SLOTS)

    def _grow(self, capacity: int) -> None:
        old = len(self.num_tokens)
        for name in (
            "token_ids",
            "num_host_tokens",
            "num_tokens",
            "num_computed",
            "block_tables",
            "num_blocks",
            "generation",
            "samples",
        ):
            array = getattr(self, name)
            grown = np.zeros((capacity, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        sampled = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        sampled[:old] = self.last_sampled
        self.last_sampled = sampled
        self.sampling_table.grow(capacity)
        self._free_slots += reversed(range(old, capacity))

    def set_kv_cache_groups(self, num_groups: int) -> None:
        """Keep a block table per KV-cache group (before any sequence is held)."""
        if self.states:
            raise RuntimeError("KV-cache groups are set before the batch holds sequences")
        self.num_groups = num_groups
        self.block_tables = np.zeros((len(self.num_blocks), num_groups, self.max_blocks), np.int64)

    @property
    def block_table(self) -> np.ndarray:
        """KV-cache group 0's block tables, [slots, max_blocks] (a view)."""
        return self.block_tables[:, 0]

    def _group_tables(
        self, seq_id: int, first: list[int], others: Sequence[list[int]]
    ) -> np.ndarray:
        """A sequence's blocks in each KV-cache group, [groups, len(first)]: `first`, then
        `others` (those of groups this batch does not keep are ignored: a draft model keeps
        one); none given: `first` alone, [len(first)], which every group's row takes."""
        if not others:
            return np.asarray(first, dtype=np.int64)
        tables = [first, *others[: self.num_groups - 1]]
        if len(tables) < self.num_groups or any(len(t) != len(first) for t in tables):
            raise ValueError(
                f"sequence {seq_id}: block ids for {len(tables)} KV-cache groups of lengths "
                f"{[len(t) for t in tables]}; the model has {self.num_groups}, one length"
            )
        return np.asarray(tables, dtype=np.int64).reshape(self.num_groups, len(first))

    def apply(self, plan: StepPlan) -> None:
        """Drop the released sequences, take in the new ones, update block tables."""
        self.release(plan.released_seq_ids)
        for seq in plan.new_seqs:
            self._add(seq)
        for update in plan.block_updates:
            slot = self.slot_of(update.seq_id)
            end = update.num_kept + len(update.appended)
            self._check_blocks(update.seq_id, end)
            tables = self._group_tables(update.seq_id, update.appended, update.group_appended)
            self.block_tables[slot, :, update.num_kept : end] = tables
            self.num_blocks[slot] = end

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            state = self.states.pop(seq_id, None)
            if state is not None:
                self._free_slots.append(state.slot)
                self.prompt_logprob_seqs.discard(seq_id)

    def slot_of(self, seq_id: int) -> int:
        state = self.states.get(seq_id)
        if state is None:
            raise ValueError(f"sequence {seq_id} is not held by this worker")
        return state.slot

    def host_token_ids(self, seq_id: int) -> np.ndarray:
        """The sequence's tokens known on the host (a view)."""
        slot = self.slot_of(seq_id)
        return self.token_ids[slot, : self.num_host_tokens[slot]]

    def _check_blocks(self, seq_id: int, num_blocks: int) -> None:
        if num_blocks > self.max_blocks:
            raise ValueError(
                f"sequence {seq_id}: {num_blocks} blocks, more than max_model_len needs "
                f"({self.max_blocks})"
            )

    def _add(self, seq: NewSequence) -> None:
        """Hold `seq` in a free slot."""
        num_tokens = len(seq.token_ids)
        if seq.seq_id in self.states:
            raise ValueError(f"sequence {seq.seq_id} is already held")
        if not 0 <= seq.num_computed_tokens < num_tokens <= self.max_tokens:
            raise ValueError(
                f"sequence {seq.seq_id}: {num_tokens} tokens ({seq.num_computed_tokens} "
                f"computed) do not fit 1..{self.max_tokens - 1} with one left to compute"
            )
        self._check_blocks(seq.seq_id, len(seq.block_ids))
        if not self._free_slots:
            self._grow(2 * len(self.num_tokens))
        slot = self._free_slots.pop()
        self.token_ids[slot, :num_tokens] = np.fromiter(seq.token_ids, np.int64, num_tokens)
        self.num_host_tokens[slot] = self.num_tokens[slot] = num_tokens
        self.num_computed[slot] = seq.num_computed_tokens
        tables = self._group_tables(seq.seq_id, seq.block_ids, seq.group_block_ids)
        self.block_tables[slot, :, : len(seq.block_ids)] = tables
        self.num_blocks[slot] = len(seq.block_ids)
        self.generation[slot] += 1
        self.samples[slot] = seq.sampling is not None
        if seq.sampling is not None:
            self.sampling_table.set(slot, seq.sampling, seq.num_first_draws)
        self.states[seq.seq_id] = SequenceState(self, slot, seq)
        if seq.sampling is not None and seq.sampling.prompt_logprobs is not None:
            self.prompt_logprob_seqs.add(seq.seq_id)

    def prepare(self, plan: StepPlan, decode_rows_up_to: int = 1) -> PreparedStep:
        """The step's inputs from the held state (after `apply`); a step of at most
        `decode_rows_up_to` new tokens a sequence after a cached context runs as decode rows
        (`DraftRows.as_decode_rows`: a draft model's catch-up passes), as verify steps do."""
        try:
            states = [self.states[seq_id] for seq_id in plan.seq_ids]
        except KeyError as missing:
            raise ValueError(f"sequence {missing.args[0]} is not held by this worker") from None
        slots = np.fromiter((s.slot for s in states), np.int64, len(states))
        query = np.asarray(plan.num_new_tokens, dtype=np.int64)
        context = self.num_computed[slots]
        drafts = self.drafts.write(plan, slots)
        total = self.num_tokens[slots] + (0 if drafts is None else num_drafts(drafts))
        if len(query) != len(slots) or (context + query > total).any():
            raise ValueError("the plan computes tokens its sequences do not have")
        width = max(int(self.num_blocks[slots].max(initial=0)), 1)
        tables = self.block_tables[slots, :, :width]
        layout = layout_from_arrays(
            tables[:, 0], self.num_blocks[slots], context, query, self.block_size,
            [tables[:, group] for group in range(1, self.num_groups)],
        )  # fmt: skip
        token_seq, positions = layout.token_seq.numpy(), layout.token_pos.numpy()
        flat_index = (slots * self.max_tokens).take(token_seq) + positions
        token_ids = torch.from_numpy(self.token_ids.ravel().take(flat_index))
        carried_at = self._carried_at(slots, context + query, token_seq, positions)
        last_tokens = layout.query_start_loc.numpy()[1:] - 1  # each sequence's, flat
        if self.drafts.as_decode_rows(plan, context, query, drafts, decode_rows_up_to):
            layout = as_decode_rows(layout)
        rows = np.flatnonzero((context + query == total) & self.samples[slots])
        sample_rows: list[int] = rows.tolist()
        sampling = [states[row] for row in sample_rows]
        metadata = self.sampling_table.gather(slots[rows], self.device)
        (draw_slots, sample_tokens), carried = self._device_indices(
            [slots[rows], last_tokens[rows]], carried_at
        )
        return PreparedStep(
            layout, token_ids, carried, slots, draw_slots, sample_tokens, query, states,
            sample_rows, sampling, metadata, drafts,
        )  # fmt: skip

    def _carried_at(
        self,
        slots: np.ndarray,
        ends: np.ndarray,
        token_seq: np.ndarray,
        positions: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Where the step's tokens that only the device knows go (flat token index), and the
        slots whose `last_sampled` they are; None when the host knows every token the step
        reads."""
        known = self.num_host_tokens[slots]
        if (ends <= known).all():
            return None
        real = self.num_tokens[slots]  # drafts lie past these, on the host
        at = np.flatnonzero(
            (positions >= known.take(token_seq)) & (positions < real.take(token_seq))
        )
        return at, slots.take(token_seq[at])

    def _device_indices(
        self, rows: list[np.ndarray], carried_at: tuple[np.ndarray, np.ndarray] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """`rows` (equal-length index arrays, one entry per sampling row) stacked on the
        device, and the carried tokens (their flat index, and the tokens from
        `last_sampled`): every index the step's device work needs, in one transfer."""
        parts = rows if carried_at is None else [*rows, *carried_at]
        packed = to_device(torch.from_numpy(np.concatenate(parts)), self.device)
        on_device = packed[: sum(map(len, rows))].view(len(rows), -1)
        if carried_at is None:
            return on_device, None
        index, source = packed[on_device.numel() :].view(2, -1)
        return on_device, (index, self.last_sampled[source])

    def advance(self, step: PreparedStep, first_draws: torch.Tensor | None) -> PendingDraws:
        """Count the step's tokens as computed and its draws (`first_draws`: each sampling row's
        first token, on the device) as known to the device; where they go on the host."""
        self.num_computed[step.slots] += step.num_new_tokens
        drew = step.slots[step.sample_rows]
        positions = self.num_tokens[drew].copy()
        self.num_tokens[drew] += 1
        self.sampling_table.num_samples[drew] = 1
        if first_draws is not None and len(drew):
            self.last_sampled[step.draw_slots] = first_draws
        return PendingDraws(drew, positions, self.generation[drew].copy())

    def commit(
        self, step: PreparedStep, first_draws: torch.Tensor | None, results: StepResults | None
    ) -> PendingDraws:
        """Take a sampled step in, once: its tokens counted as computed (`advance`) and its
        sampling rows' first draws known to the device (`first_draws`; from `results` where
        None). With `results` (read on the host) those draws are written on the host too
        (`record`), and after drafts each row takes the drafts it accepted and the token drawn
        after them. Answers where the first draws go on the host, for a step read later."""
        if results is None:
            return self.advance(step, first_draws)
        rows = step.sample_rows
        kept = [results[row] for row in rows]
        firsts = [result.token_ids[0] for result in kept if result is not None]
        if first_draws is None and firsts:
            first_draws = device_tensor(firsts, self.device)
        pending = self.advance(step, first_draws)
        self.record(pending, firsts)
        if step.drafts is not None:
            self.drafts.take_verified(step.slots[rows], [step.drafts[row] for row in rows], kept)
        return pending

    def record(self, pending: PendingDraws, tokens: list[int]) -> None:
        """Write a resolved step's first draws into the host arrays, where their sequences
        are still held."""
        alive = self.generation[pending.slots] == pending.generations
        slots, positions = pending.slots[alive], pending.positions[alive]
        self.token_ids[slots, positions] = np.asarray(tokens, dtype=np.int64)[alive]
        self.num_host_tokens[slots] = positions + 1
