"""`BlockAllocator`: the pool of KV-cache block ids, with reference counts and a prefix cache.

Blocks are plain integers 0..num_blocks-1 indexing the cache tensors along their block axis.
Running out is reported with `OutOfBlocksError` (nothing is allocated then) so the scheduler can
preempt; it is never a crash.

With prefix caching, a full block can be registered under the chained hash of its tokens. When
its last holder frees it, it keeps its contents and stays findable (an evictable block) until an
allocation needs the space: free, unhashed blocks go first, then evictable ones, least recently
used first. A sequence's whole table is taken, shared or freed in one call: free ids come off a
stack in one slice, and the range and holder checks run over the whole table at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a full block: its tokens and the hash of the block before it."""
    return hash((parent, tokens))


class BlockAllocator:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the next block is last
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take `num_blocks` blocks (reference count 1 each), all or none."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {self.num_free_blocks} of {self.num_blocks} free"
            )
        start = max(len(self._free) - num_blocks, 0)
        blocks = self._free[start:][::-1]
        del self._free[start:]
        blocks += [self._evict_one() for _ in range(num_blocks - len(blocks))]
        counts = self._ref_counts
        for block in blocks:
            counts[block] = 1
        return blocks

    def _evict_one(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        self._forget_hash(block)
        return block

    def share(self, blocks: Iterable[int]) -> None:
        """Add one holder to each of `blocks` (they must be allocated)."""
        counts = self._ref_counts
        for block in self._held(blocks):
            counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder from each of `blocks`; a block with no holder left is free again
        (kept findable if it is registered in the prefix cache). Nothing changes if any of
        them is not held (as often as it appears)."""
        held = self._held(blocks)
        counts = self._ref_counts
        released = []
        for block in held:
            counts[block] -= 1
            if not counts[block]:
                released.append(block)
        if min(map(counts.__getitem__, held), default=0) < 0:
            for block in held:
                counts[block] += 1
            raise ValueError(f"blocks {held} freed more often than held (double free?)")
        if not self._hash_of:
            self._free += released
            return
        for block in released:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def register(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Make a full, computed block findable by its chained hash (first writer wins)."""
        if not self.enable_prefix_caching or block_hash in self._block_of:
            return
        if block in self._hash_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._tokens_of[block] = tokens

    def cached_block(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `tokens` under `block_hash`, if any."""
        block = self._block_of.get(block_hash)
        return None if block is None or self._tokens_of[block] != tokens else block

    def hold_cached(self, block_hash: int, tokens: tuple[int, ...]) -> int:
        """`cached_block`, with one more holder (RuntimeError if it is not cached)."""
        block = self.cached_block(block_hash, tokens)
        if block is None:
            raise RuntimeError(f"no cached block holds {tokens} under {block_hash}")
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1
        return block

    def record_prefix_match(self, num_queried: int, num_hits: int) -> None:
        """Count a prompt's prefix lookup: of its `num_queried` full blocks, `num_hits` hit."""
        self.prefix_queries += num_queried
        self.prefix_hits += num_hits

    def _forget_hash(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        del self._tokens_of[block]

    def _held(self, blocks: Iterable[int]) -> list[int]:
        """`blocks` as a list, each checked to be in range and allocated (the checks run over
        the whole list at once; the first bad block is named)."""
        held = list(blocks)
        if held and not (min(held) >= 0 and max(held) < self.num_blocks):
            block = next(b for b in held if not 0 <= b < self.num_blocks)
            raise ValueError(f"block {block} out of range 0..{self.num_blocks - 1}")
        if 0 in map(self._ref_counts.__getitem__, held):
            block = next(b for b in held if not self._ref_counts[b])
            raise ValueError(f"block {block} is not allocated (double free?)")
        return held
