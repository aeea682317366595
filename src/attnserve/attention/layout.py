"""The validated, tensorised view of one step's batch that every metadata builder starts from.

Builders differ in what they hand their kernels; they all need the same facts first: which
sequence and position each new token has, its cache slot, and the padded block table. This
module computes them with a handful of tensor ops (no Python loop over tokens), once per step
for the model runner and every builder (the model's positions are `token_pos`); a model of
several KV-cache groups has a block table and slots per group (`for_group`). It also recasts a
step of a few new tokens per sequence as decode rows. (A graph step's padding:
`worker.graphs.padding`; helpers only backends use: `attention.backends.utils`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import numpy as np
import torch

from attnserve.host_copy import to_device
from attnserve.step_types import is_prefill


@dataclass(frozen=True)
class StepLayout:
    """Host (CPU) tensors describing one step; B sequences, T new tokens."""

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    context_lens: torch.Tensor  # [B] int64: tokens already cached
    query_lens: torch.Tensor  # [B] int64: new tokens this step
    seq_lens: torch.Tensor  # [B] int64: context + query
    query_start_loc: torch.Tensor  # [B + 1] int64: offsets of each sequence's new tokens
    block_table: torch.Tensor  # [B, max_blocks] int64, padded with 0
    token_seq: torch.Tensor  # [T] int64: sequence index of each new token
    token_pos: torch.Tensor  # [T] int64: position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    # KV-cache groups 1.. (group 0's are the fields above): each (block_table, slot_mapping)
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    def for_group(self, group: int) -> StepLayout:
        """The layout as KV-cache group `group`'s layers see it: its block table and slots."""
        if group == 0:
            return self
        if not 0 < group <= len(self.group_tables):
            raise ValueError(f"the step's layout has no KV-cache group {group}")
        table, slots = self.group_tables[group - 1]
        return replace(self, block_table=table, slot_mapping=slots, group_tables=())

    def common_metadata(self, device: torch.device | str) -> dict[str, Any]:
        """The fields of `AttentionMetadata` (every backend's metadata starts with them): the
        step's counts, and the slot mapping on `device`."""
        return {
            "num_prefills": self.num_prefills,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "slot_mapping": to_device(self.slot_mapping, device),
        }


def _int64s(values: Sequence[int]) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _padded_table(
    block_tables: Sequence[Sequence[int]], lens: np.ndarray, width: int
) -> np.ndarray:
    """The tables as one [B, width] int64 array, padded with 0, built from one flat array
    rather than one per table."""
    flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int64, count=int(lens.sum()))
    table = np.zeros((len(lens), width), dtype=np.int64)
    table[np.arange(width) < lens[:, None]] = flat
    return table


def _validate(lens: np.ndarray, ctx: np.ndarray, qry: np.ndarray, block_size: int) -> int:
    """Check each sequence (the first bad one is reported) and return the number of prefill
    sequences, which must lead the batch."""
    prefill = is_prefill(qry, ctx)
    num_prefills = len(prefill) if prefill.all() else int(np.argmin(prefill))
    needed = -(-(ctx + qry) // block_size)
    bad_lens, short = (qry < 1) | (ctx < 0), lens < needed
    late = prefill & (np.arange(len(prefill)) > num_prefills)
    bad = np.flatnonzero(bad_lens | short | late)
    if not len(bad):
        return num_prefills
    i = int(bad[0])
    if bad_lens[i]:
        raise ValueError(f"sequence {i}: query_len must be >= 1 and context_len >= 0")
    if short[i]:
        raise ValueError(
            f"sequence {i}: {ctx[i] + qry[i]} tokens need {needed[i]} blocks of {block_size}, "
            f"block table has {lens[i]}"
        )
    raise ValueError(f"sequence {i} is a prefill after a decode: prefills must come first")


def build_step_layout(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    group_block_tables: Sequence[Sequence[Sequence[int]]] = (),
) -> StepLayout:
    """Validate one step's batch and compute its token positions, slots and block table (and
    those of KV-cache groups 1.., from `group_block_tables`: each as long as `block_tables`)."""
    if not len(block_tables) == len(context_lens) == len(query_lens):
        raise ValueError(
            f"block_tables ({len(block_tables)}), context_lens ({len(context_lens)}) and "
            f"query_lens ({len(query_lens)}) must have one entry per sequence"
        )
    lens = _int64s([len(t) for t in block_tables])
    width = max(int(lens.max(initial=0)), 1)
    table = _padded_table(block_tables, lens, width)
    groups = []
    for tables in group_block_tables:
        if [len(t) for t in tables] != lens.tolist():
            raise ValueError("each KV-cache group's block tables must be as long as group 0's")
        groups.append(_padded_table(tables, lens, width))
    ctx, qry = _int64s(context_lens), _int64s(query_lens)
    return layout_from_arrays(table, lens, ctx, qry, block_size, groups)


def layout_from_arrays(
    block_table: np.ndarray,
    num_blocks: np.ndarray,
    context_lens: np.ndarray,
    query_lens: np.ndarray,
    block_size: int,
    group_tables: Sequence[np.ndarray] = (),
) -> StepLayout:
    """`build_step_layout` from int64 arrays: the [B, W] block table (row i's first
    `num_blocks[i]` entries are its blocks), and each sequence's context and query lengths;
    `group_tables` are the block tables of KV-cache groups 1.., shaped as the first."""
    ctx, qry, table = context_lens, query_lens, block_table
    num_prefills = _validate(num_blocks, ctx, qry, block_size)
    if any(t.size and int(t.min()) < 0 for t in (table, *group_tables)):
        raise ValueError("block ids must be >= 0")
    start_loc = np.zeros(len(qry) + 1, dtype=np.int64)
    np.cumsum(qry, out=start_loc[1:])
    num_tokens = int(start_loc[-1])
    token_seq = np.repeat(np.arange(len(qry)), qry)
    token_pos = np.arange(num_tokens) + np.repeat(ctx - start_loc[:-1], qry)
    block_index, offset = _block_and_offset(token_pos, block_size)
    block_index += token_seq * table.shape[1]

    def slots_of(blocks: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(blocks.ravel().take(block_index) * block_size + offset)

    num_prefill_tokens = int(start_loc[num_prefills])
    as_tensor = torch.from_numpy
    return StepLayout(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=num_tokens - num_prefill_tokens,
        context_lens=as_tensor(ctx),
        query_lens=as_tensor(qry),
        seq_lens=as_tensor(ctx + qry),
        query_start_loc=as_tensor(start_loc),
        block_table=as_tensor(table),
        token_seq=as_tensor(token_seq),
        token_pos=as_tensor(token_pos),
        slot_mapping=slots_of(table),
        group_tables=tuple((as_tensor(t), slots_of(t)) for t in group_tables),
    )


def _block_and_offset(token_pos: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position's block index and offset in it (shifts and masks for a power of two,
    several times faster than integer division)."""
    if block_size & (block_size - 1):
        return np.divmod(token_pos, block_size)
    return token_pos >> (block_size.bit_length() - 1), token_pos & (block_size - 1)


def as_decode_rows(layout: StepLayout) -> StepLayout:
    """The layout's new tokens as a decode-only step: each token a one-token sequence of its
    own, whose context is every token before it in its sequence, its block table row that
    sequence's. Each attention layer writes every new token's K/V into the cache before it
    reads any, so a token's row sees the new tokens before it in its sequence as context: the
    step computes what the original does, through the decode kernels (and decode graphs).
    Speculative decoding verifies its drafts so: a few new tokens per sequence."""
    token_seq, positions = layout.token_seq, layout.token_pos
    num_tokens = len(token_seq)
    return StepLayout(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decode_tokens=num_tokens,
        context_lens=positions,
        query_lens=torch.ones(num_tokens, dtype=torch.int64),
        seq_lens=positions + 1,
        query_start_loc=torch.arange(num_tokens + 1),
        block_table=layout.block_table[token_seq],
        token_seq=torch.arange(num_tokens),
        token_pos=positions,
        slot_mapping=layout.slot_mapping,
        group_tables=tuple((t[token_seq], s) for t, s in layout.group_tables),
    )
