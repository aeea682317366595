"""`BlockTable`: one sequence's ordered KV blocks in each KV-cache group, grown as its tokens grow.

A model's attention layers form one KV-cache group or several (`attention.kv_cache_groups`):
each group has its own table, all as long as the sequence needs (a block per `block_size`
tokens), drawn from one pool. A group of sliding-window layers frees the blocks its next tokens
can no longer see as the sequence advances (`commit_computed`); their places keep their old ids,
no longer held (the ranks' tables keep them too: the window layers never read them), so the
ranks need no update for it. Group 0 (global layers, when there are any) keeps every block.

With prefix caching it also finds the cached blocks of a new sequence's longest cached prefix
(in a window group only the blocks within the window of the first token to compute are needed),
and registers each block once it is full and computed, under the chained hash of its tokens
(and its group). A sequence with a LoRA adapter keys its blocks by the adapter too (its id leads
each block's tokens as a negative number), so no other adapter, nor the base model, reuses them.
It also knows how much of itself the ranks hold (`take_update`), so a step plan sends only the
blocks appended or replaced since the last one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from attnserve.engine.core.block_allocator import BlockAllocator, OutOfBlocksError, chain_hash
from attnserve.step_types import BlockPairs

STALE = 0  # the id kept in a place never held (before a cached prefix's window): never read


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def max_sequence_tokens(
    num_blocks: int, block_size: int, windows: Sequence[int | None], max_chunk: int
) -> int:
    """The most tokens one sequence's tables can hold in a pool of `num_blocks` when it
    computes at most `max_chunk` tokens a step: a window group holds at most the blocks of its
    window and a chunk; the others a block per `block_size` tokens (sys.maxsize: no limit)."""
    caps = [blocks_needed(w - 1 + max_chunk, block_size) + 1 for w in windows if w is not None]
    num_keeping = len(windows) - len(caps)
    if not num_keeping:
        return sys.maxsize if sum(caps) <= num_blocks else 0

    def fits(blocks: int) -> bool:  # this many blocks in each keeping group
        return num_keeping * blocks + sum(min(blocks, cap) for cap in caps) <= num_blocks

    low, high = 0, num_blocks  # fits(low); the answer is at most high
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low * block_size


class BlockTable:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        windows: Sequence[int | None] = (None,),
        lora_int_id: int = 0,
    ) -> None:
        if not windows:
            raise ValueError("a block table needs at least one KV-cache group")
        self.allocator = allocator
        self.block_size = block_size
        self.windows = tuple(windows)  # each group's sliding window (None: keeps every block)
        self.lora_int_id = lora_int_id  # the sequence's LoRA adapter (0: none), in every key
        self.tables: list[list[int]] = [[] for _ in self.windows]
        self.num_released = [0] * len(self.windows)  # each table's leading places not held
        self.block_hashes: list[int] = []  # of blocks[0 .. len-1], each full and registered
        self._num_synced: int | None = None  # blocks the ranks hold as here; None: no table
        self._swapped: tuple[int, list[int]] | None = None  # swapped out: (length, released)

    @property
    def blocks(self) -> list[int]:
        """Group 0's table."""
        return self.tables[0]

    @blocks.setter
    def blocks(self, blocks: list[int]) -> None:
        self.tables[0] = blocks

    def held_blocks(self) -> list[int]:
        """Every block the table holds, group by group, in order."""
        return [b for t, r in zip(self.tables, self.num_released, strict=True) for b in t[r:]]

    @property
    def num_held_blocks(self) -> int:
        """len(held_blocks()), without building the list."""
        return sum(len(t) - r for t, r in zip(self.tables, self.num_released, strict=True))

    @property
    def is_synced(self) -> bool:
        """Whether the ranks hold a version of this table (`mark_synced` since the last free)."""
        return self._num_synced is not None

    def mark_synced(self) -> None:
        """The ranks now hold the whole table as it is."""
        self._num_synced = len(self.blocks)

    def take_update(self) -> tuple[int, list[list[int]]] | None:
        """What changed since the ranks last saw the table, as (blocks kept, each group's blocks
        after them), now marked as seen; None when nothing did."""
        if self._num_synced is None:
            raise RuntimeError("the ranks hold no version of this block table")
        kept = self._num_synced
        if kept == len(self.blocks):
            return None
        self._num_synced = len(self.blocks)
        return kept, [table[kept:] for table in self.tables]

    @property
    def capacity(self) -> int:
        """How many tokens the held blocks can store."""
        return len(self.blocks) * self.block_size

    def extra_blocks_for(self, num_tokens: int) -> int:
        """How many more blocks holding `num_tokens` tokens would take (in all groups; a
        swapped-out table's blocks to bring back included)."""
        length, restore = len(self.blocks), 0
        if self._swapped is not None:
            length, released = self._swapped
            restore = sum(length - r for r in released)
        return self._growth(num_tokens, length) * len(self.tables) + restore

    def ensure_capacity(self, num_tokens: int) -> None:
        """Grow to hold `num_tokens` tokens; OutOfBlocksError (taking nothing) if short."""
        growth = self._growth(num_tokens, len(self.blocks))
        new = self.allocator.allocate(growth * len(self.tables))
        for index, table in enumerate(self.tables):
            table += new[index * growth : (index + 1) * growth]

    def _growth(self, num_tokens: int, length: int) -> int:
        """Places each group's table must gain past `length` to hold `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - length)

    def _block_tokens(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
        return (-self.lora_int_id, *tokens) if self.lora_int_id else tokens

    def _key(self, group: int, block_hash: int) -> int:
        """The prefix cache's key of a block of `group` (group 0: the chained hash itself)."""
        return block_hash if group == 0 else hash((group, block_hash))

    def _first_needed(self, group: int, position: int) -> int:
        """The first block a token at `position` (and any after it) reads in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def match_prefix(self, token_ids: list[int]) -> int:
        """For an empty table, take the cached blocks of the longest cached prefix of
        `token_ids`, leaving at least one token to compute; return the tokens they hold."""
        if self.blocks:
            raise ValueError("match_prefix needs an empty block table")
        if not self.allocator.enable_prefix_caching:
            return 0
        hashes: list[int] = []
        num_full_blocks = (len(token_ids) - 1) // self.block_size
        for index in range(num_full_blocks):
            tokens = self._block_tokens(token_ids, index)
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens)
            if self.windows[0] is None and self.allocator.cached_block(block_hash, tokens) is None:
                break  # group 0 reads every block: the prefix ends at its first miss
            hashes.append(block_hash)
        length = len(hashes)
        checked = 1 if self.windows[0] is None else 0  # group 0's blocks: looked up above
        for group in range(checked, len(self.tables)):
            length = self._cached_length(group, hashes[:length], token_ids)
        for group, table in enumerate(self.tables):
            first = self._first_needed(group, length * self.block_size)
            table += [STALE] * first
            table += [
                self.allocator.hold_cached(
                    self._key(group, hashes[index]), self._block_tokens(token_ids, index)
                )
                for index in range(first, length)
            ]
            self.num_released[group] = first
        self.allocator.record_prefix_match(num_full_blocks, length)
        self.block_hashes = hashes[:length]
        return self.capacity

    def _cached_length(self, group: int, hashes: list[int], token_ids: list[int]) -> int:
        """The longest prefix of the blocks of `hashes` such that every block of `group` that
        the token after it reads is cached."""
        cached = [
            self.allocator.cached_block(self._key(group, h), self._block_tokens(token_ids, i))
            is not None
            for i, h in enumerate(hashes)
        ]
        run = 0  # cached blocks ending at the current one
        runs = []
        for hit in cached:
            run = run + 1 if hit else 0
            runs.append(run)
        for length in range(len(cached), 0, -1):
            if runs[length - 1] >= length - self._first_needed(group, length * self.block_size):
                return length
        return 0

    def commit_computed(self, token_ids: list[int], num_computed_tokens: int) -> None:
        """The first `num_computed_tokens` tokens are in the cache: register every block now
        full of them (prefix caching), and free the blocks window groups no longer read."""
        if self.allocator.enable_prefix_caching:
            for index in range(len(self.block_hashes), num_computed_tokens // self.block_size):
                tokens = self._block_tokens(token_ids, index)
                parent = self.block_hashes[-1] if self.block_hashes else None
                block_hash = chain_hash(parent, tokens)
                for group, table in enumerate(self.tables):
                    if index >= self.num_released[group]:
                        self.allocator.register(table[index], self._key(group, block_hash), tokens)
                self.block_hashes.append(block_hash)
        for group, table in enumerate(self.tables):
            first = min(self._first_needed(group, num_computed_tokens), len(table))
            if first > self.num_released[group]:
                self.allocator.free(table[self.num_released[group] : first])
                self.num_released[group] = first

    def fork(self) -> BlockTable:
        """A table sharing every block of this one (one more holder each)."""
        twin = BlockTable(self.allocator, self.block_size, self.windows, self.lora_int_id)
        self.allocator.share(self.held_blocks())
        twin.tables = [list(table) for table in self.tables]
        twin.num_released = list(self.num_released)
        twin.block_hashes = list(self.block_hashes)
        return twin

    def prepare_write(self, start: int, end: int) -> BlockPairs:
        """Make tokens start..end-1 writable: copy shared blocks they fall in (copy-on-write)
        and grow to hold them. Returns the (src, dst) block copies the worker must make first.
        All or nothing: OutOfBlocksError leaves the table as it was."""
        if self._writes_in_place(start, end):
            return []  # the common decode: one token into a block already held, unshared
        first, last = start // self.block_size, min(end - 1, self.capacity - 1) // self.block_size
        shared = [
            (table, i)
            for table in self.tables
            for i in range(first, last + 1)
            if self.allocator.ref_count(table[i]) > 1
        ]
        if not self.allocator.can_allocate(len(shared) + self.extra_blocks_for(end)):
            raise OutOfBlocksError(f"copy-on-write of {len(shared)} blocks and growth to {end}")
        copies = []
        for (table, index), new in zip(shared, self.allocator.allocate(len(shared)), strict=True):
            copies.append((table[index], new))
            self.allocator.free([table[index]])
            table[index] = new
            if self._num_synced is not None:
                self._num_synced = min(self._num_synced, index)
        self.ensure_capacity(end)
        return copies

    def _writes_in_place(self, start: int, end: int) -> bool:
        """Whether tokens start..end-1 all fall in one held block of each group that no other
        table shares."""
        index = start // self.block_size
        return (
            (end - 1) // self.block_size == index
            and index < len(self.blocks)
            and all(self.allocator.ref_count(table[index]) == 1 for table in self.tables)
        )

    def swap_out(self) -> list[int]:
        """Give up every block (returned, as `held_blocks` orders them) for a swap-out;
        `swap_in` takes as many again, in the same places."""
        held, swapped = self.held_blocks(), (len(self.blocks), self.num_released)
        self._release(held)
        self._swapped = swapped
        return held

    def swap_in(self, host_blocks: list[int]) -> BlockPairs:
        """After `swap_out`: take blocks for the places held before (OutOfBlocksError, taking
        nothing, if short); return the (host block, device block) copies that fill them."""
        if self._swapped is None:
            raise RuntimeError("swap_in of a block table that is not swapped out")
        length, released = self._swapped
        new = iter(self.allocator.allocate(sum(length - r for r in released)))
        self.tables = [[STALE] * r + [next(new) for _ in range(length - r)] for r in released]
        self.num_released, self._swapped = released, None
        return list(zip(host_blocks, self.held_blocks(), strict=True))

    def free(self) -> None:
        """Release every block (one holder each)."""
        self._release(self.held_blocks())

    def _release(self, held: list[int]) -> None:
        """Release `held` (every block the table holds) and empty the table."""
        self.allocator.free(held)
        self.tables = [[] for _ in self.windows]
        self.num_released = [0] * len(self.windows)
        self.block_hashes = []
        self._num_synced = None
        self._swapped = None
