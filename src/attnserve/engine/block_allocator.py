"""`BlockAllocator`: the pool of KV-cache block ids, with reference counts for sharing.

Blocks are plain integers 0..num_blocks-1 indexing the cache tensors along their block axis.
Running out is reported with `OutOfBlocksError` (nothing is allocated then) so the scheduler can
preempt; it is never a crash.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take `num_blocks` free blocks (reference count 1 each), all or none."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            raise OutOfBlocksError(
                f"need {num_blocks} KV blocks, {len(self._free)} of {self.num_blocks} free"
            )
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one holder to each of `blocks` (they must be allocated)."""
        for block in blocks:
            self._check_held(block)
            self._ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one holder from each of `blocks`; a block with no holder left is free again."""
        for block in blocks:
            self._check_held(block)
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def _check_held(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} out of range 0..{self.num_blocks - 1}")
        if self._ref_counts[block] == 0:
            raise ValueError(f"block {block} is not allocated (double free?)")
