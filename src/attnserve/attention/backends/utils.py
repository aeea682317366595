"""Helpers the concrete backends share, and only they use: the dense query grid of backends that
pad queries into [B, Q] batches, the plain-torch slot write of KV layouts whose K and V planes
flatten to [slots, Hkv, D], the block table as the kernels' int32, the fixed buffers that
captured decode steps of block-table backends read, the project-named cache
that just-in-time-compiling kernel libraries build into, and whether such a library imports."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention.layout import StepLayout
from attnserve.host_copy import to_device
from attnserve.native.build import cache_root


@dataclass(frozen=True)
class QueryGrid:
    """Some sequences' new tokens padded into a [B, Q] grid of query rows (host tensors), for
    backends whose kernels take dense batches."""

    tokens: slice  # the sequences' new tokens in the flat batch
    num_rows: int  # Q: their longest query
    row_of_token: torch.Tensor  # [Tg] flat index of each token's row in the [B * Q] grid
    grid_token: torch.Tensor  # [B * Q] flat-batch token of each row (padding: 0)
    query_pos: torch.Tensor  # [B * Q] position of each row (padding: `padding_pos`)


def query_grid(layout: StepLayout, seqs: range, padding_pos: int) -> QueryGrid:
    """The query grid of the layout's sequences `seqs` (consecutive, at least one)."""
    loc = layout.query_start_loc
    tokens = slice(int(loc[seqs.start]), int(loc[seqs.stop]))
    token_seq = layout.token_seq[tokens]
    column = torch.arange(tokens.start, tokens.stop) - loc[token_seq]
    num_rows = int(layout.query_lens[seqs.start : seqs.stop].max())
    row_of_token = (token_seq - seqs.start) * num_rows + column
    grid_token = torch.zeros(len(seqs) * num_rows, dtype=torch.int64)
    grid_token[row_of_token] = torch.arange(tokens.start, tokens.stop)
    query_pos = torch.full((len(seqs) * num_rows,), padding_pos, dtype=torch.int64)
    query_pos[row_of_token] = layout.token_pos[tokens]
    return QueryGrid(tokens, num_rows, row_of_token, grid_token, query_pos)


def write_to_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K/V ([T, Hkv*D]) into its slot of the flat [slots, Hkv, D] caches,
    skipping padding (slot -1)."""
    written = slot_mapping >= 0
    slots = slot_mapping[written]
    k_cache[slots] = key.view(-1, *k_cache.shape[1:])[written]
    v_cache[slots] = value.view(-1, *v_cache.shape[1:])[written]


def int32_on(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor as int32 (the kernels' type) on `device`, in one transfer."""
    return to_device(host.to(torch.int32), device)


def int32_block_table(layout: StepLayout, device: torch.device | str) -> torch.Tensor:
    """The layout's [B, W] block table as int32 on `device`, in one transfer."""
    return int32_on(layout.block_table, device)


@dataclass(frozen=True)
class DecodeGraphBuffers:
    """The device tensors captured decode steps of a block-table backend read, sized for the
    largest bucket (`init_graph_buffers`), refilled before each replay (`fill`)."""

    block_table: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context + the new token
    slot_mapping: torch.Tensor  # [S] int64
    query_start_loc: torch.Tensor  # [S + 1] int32: 0, 1, 2, ... (one token per sequence)
    max_seq_len: int  # the longest context any replay may hold

    @classmethod
    def allocate(
        cls, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> DecodeGraphBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            block_table=zeros(max_num_seqs, max_blocks_per_seq),
            seq_lens=zeros(max_num_seqs),
            slot_mapping=zeros(max_num_seqs, dtype=torch.int64),
            query_start_loc=torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device),
            max_seq_len=max_blocks_per_seq * block_size,
        )

    def fill(self, layout: StepLayout, device: torch.device) -> dict[str, Any]:
        """Copy a padded decode layout into the buffers; the metadata fields it gives: the
        common ones and the buffers' views for its sequences."""
        size = layout.num_seqs
        rows, width = slice(0, size), layout.block_table.shape[1]
        self.block_table[rows, :width].copy_(int32_block_table(layout, device), non_blocking=True)
        self.seq_lens[rows].copy_(layout.seq_lens, non_blocking=True)
        self.slot_mapping[rows].copy_(layout.slot_mapping, non_blocking=True)
        return {
            "num_prefills": 0,
            "num_prefill_tokens": 0,
            "num_decode_tokens": size,
            "slot_mapping": self.slot_mapping[rows],
            "block_table": self.block_table[rows],
            "seq_lens": self.seq_lens[rows],
            "query_start_loc": self.query_start_loc[: size + 1],
        }


def use_project_kernel_cache(env_var: str, library: str) -> None:
    """Point a kernel library's JIT cache (its variable `env_var`) into attnserve's cache root
    (~/.cache/attnserve/kernels/LIBRARY, or under $ATTNSERVE_CACHE_DIR), so its kernels are
    built once per machine; a value the user set wins. Call before the library's import."""
    os.environ.setdefault(env_var, str(cache_root() / "kernels" / library))


@functools.cache
def import_failure(module: str) -> str | None:
    """Why the installed `module` cannot be imported here (None: it imports), checked once per
    process, so a broken install makes its backend unavailable with the reason instead of failing
    the engine later."""
    try:
        importlib.import_module(module)
    except Exception as error:  # a broken install raises anything (RuntimeError, OSError, ...)
        return f"{module} is installed but cannot be imported: {type(error).__name__}: {error}"
    return None
