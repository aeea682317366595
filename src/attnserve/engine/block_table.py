"""`BlockTable`: one sequence's ordered list of KV blocks, grown as its tokens grow."""

from __future__ import annotations

from attnserve.engine.block_allocator import BlockAllocator


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockTable:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []

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

    def slot(self, position: int) -> int:
        """The flat cache slot of token `position`."""
        if not 0 <= position < self.capacity:
            raise ValueError(f"position {position} outside this table's {self.capacity} slots")
        return self.blocks[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def free(self) -> None:
        """Release every block (one holder each)."""
        self.allocator.free(self.blocks)
        self.blocks = []
