"""`BlockTable`: one sequence's ordered list of KV blocks, grown as its tokens grow.

With prefix caching it also finds the cached blocks of a new sequence's longest cached prefix,
and registers each block once it is full and computed, under the chained hash of its tokens. It
also knows how much of itself the ranks hold (`take_update`), so a step plan sends only the
blocks appended or replaced since the last one.
"""

from __future__ import annotations

from attnserve.engine.core.block_allocator import BlockAllocator, OutOfBlocksError, chain_hash


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockTable:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []  # of blocks[0 .. len-1], each full and registered
        self._num_synced: int | None = None  # blocks the ranks hold as here; None: no table

    @property
    def is_synced(self) -> bool:
        """Whether the ranks hold a version of this table (`mark_synced` since the last free)."""
        return self._num_synced is not None

    def mark_synced(self) -> None:
        """The ranks now hold the whole table as it is."""
        self._num_synced = len(self.blocks)

    def take_update(self) -> tuple[int, list[int]] | None:
        """What changed since the ranks last saw the table, as (blocks kept, blocks after
        them), now marked as seen; None when nothing did."""
        if self._num_synced is None:
            raise RuntimeError("the ranks hold no version of this block table")
        kept = self._num_synced
        if kept == len(self.blocks):
            return None
        self._num_synced = len(self.blocks)
        return kept, self.blocks[kept:]

    @property
    def capacity(self) -> int:
        """How many tokens the held blocks can store."""
        return len(self.blocks) * self.block_size

    def extra_blocks_for(self, num_tokens: int) -> int:
        """How many more blocks holding `num_tokens` tokens would take."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(self.blocks))

    def ensure_capacity(self, num_tokens: int) -> None:
        """Grow to hold `num_tokens` tokens; OutOfBlocksError (taking nothing) if short."""
        self.blocks += self.allocator.allocate(self.extra_blocks_for(num_tokens))

    def _block_tokens(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])

    def match_prefix(self, token_ids: list[int]) -> int:
        """For an empty table, take the cached blocks of the longest cached prefix of
        `token_ids`, leaving at least one token to compute; return the tokens they hold."""
        if self.blocks:
            raise ValueError("match_prefix needs an empty block table")
        parent: int | None = None
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = self._block_tokens(token_ids, index)
            block_hash = chain_hash(parent, tokens)
            block = self.allocator.acquire_cached(block_hash, tokens)
            if block is None:
                break
            self.blocks.append(block)
            self.block_hashes.append(block_hash)
            parent = block_hash
        return self.capacity

    def register_full_blocks(self, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register every block that is now full of computed tokens."""
        if not self.allocator.enable_prefix_caching:
            return
        for index in range(len(self.block_hashes), num_computed_tokens // self.block_size):
            tokens = self._block_tokens(token_ids, index)
            parent = self.block_hashes[-1] if self.block_hashes else None
            block_hash = chain_hash(parent, tokens)
            self.allocator.register(self.blocks[index], block_hash, tokens)
            self.block_hashes.append(block_hash)

    def fork(self) -> BlockTable:
        """A table sharing every block of this one (one more holder each)."""
        twin = BlockTable(self.allocator, self.block_size)
        self.allocator.share(self.blocks)
        twin.blocks = list(self.blocks)
        twin.block_hashes = list(self.block_hashes)
        return twin

    def prepare_write(self, start: int, end: int) -> list[tuple[int, int]]:
        """Make tokens start..end-1 writable: copy shared blocks they fall in (copy-on-write)
        and grow to hold them. Returns the (src, dst) block copies the worker must make first.
        All or nothing: OutOfBlocksError leaves the table as it was."""
        if self._writes_in_place(start, end):
            return []  # the common decode: one token into a block already held, unshared
        first, last = start // self.block_size, min(end - 1, self.capacity - 1) // self.block_size
        shared = [i for i in range(first, last + 1) if self.allocator.ref_count(self.blocks[i]) > 1]
        if not self.allocator.can_allocate(len(shared) + self.extra_blocks_for(end)):
            raise OutOfBlocksError(f"copy-on-write of {len(shared)} blocks and growth to {end}")
        copies = []
        for index, new in zip(shared, self.allocator.allocate(len(shared)), strict=True):
            copies.append((self.blocks[index], new))
            self.allocator.free([self.blocks[index]])
            self.blocks[index] = new
            if self._num_synced is not None:
                self._num_synced = min(self._num_synced, index)
        self.ensure_capacity(end)
        return copies

    def _writes_in_place(self, start: int, end: int) -> bool:
        """Whether tokens start..end-1 all fall in one held block that no other table shares."""
        index = start // self.block_size
        return (
            (end - 1) // self.block_size == index
            and index < len(self.blocks)
            and self.allocator.ref_count(self.blocks[index]) == 1
        )

    def free(self) -> None:
        """Release every block (one holder each)."""
        self.allocator.free(self.blocks)
        self.blocks = []
        self.block_hashes = []
        self._num_synced = None
