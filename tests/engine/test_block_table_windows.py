"""BlockTable over several KV-cache groups: a window group frees the blocks its next tokens
cannot see, keeps its places, and still copies, forks, swaps, caches prefixes and frees
everything it holds exactly once."""

from __future__ import annotations

import sys

from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable, max_sequence_tokens

BLOCK = 4
WINDOW = 8
WINDOWS = (None, WINDOW)  # a global group, a window group


def _computed(pool: BlockAllocator, tokens: list[int]) -> BlockTable:
    table = BlockTable(pool, BLOCK, WINDOWS)
    table.ensure_capacity(len(tokens))
    table.commit_computed(tokens, len(tokens))
    return table


def test_a_window_group_frees_what_the_next_token_cannot_see() -> None:
    pool = BlockAllocator(64)
    table = _computed(pool, list(range(29)))
    # the token at 29 reads 22..29: blocks 0-4 (tokens 0..19) of the window group are freed
    assert table.num_released == [0, 5]
    assert len(table.blocks) == len(table.tables[1]) == 8
    assert len(table.held_blocks()) == 8 + 3
    assert pool.num_free_blocks == 64 - 11
    table.free()
    assert pool.num_free_blocks == 64


def test_each_position_keeps_its_window() -> None:
    """Released places stay put: the held blocks are the last ones, at their indices."""
    pool = BlockAllocator(64)
    table = BlockTable(pool, BLOCK, WINDOWS)
    tokens = list(range(40))
    for computed in range(1, 41):
        table.ensure_capacity(computed)
        table.commit_computed(tokens, computed)
        first_read = max(0, computed - WINDOW + 1) // BLOCK
        assert table.num_released[1] == first_read
        assert pool.num_free_blocks == 64 - len(table.held_blocks())
    table.free()
    assert pool.num_free_blocks == 64


def test_fork_copy_on_write_and_free_hold_each_block_once() -> None:
    pool = BlockAllocator(64)
    table = _computed(pool, list(range(30)))
    twin = table.fork()
    copies = twin.prepare_write(30, 31)  # into the shared last block of both groups
    assert len(copies) == 2
    assert twin.tables[0][-1] != table.tables[0][-1] and twin.tables[1][-1] != table.tables[1][-1]
    table.free()
    twin.free()
    assert pool.num_free_blocks == 64


def test_swap_out_and_in_keep_the_places() -> None:
    pool = BlockAllocator(64)
    table = _computed(pool, list(range(29)))
    held = table.swap_out()
    assert len(held) == 11 and pool.num_free_blocks == 64
    assert table.extra_blocks_for(29) == 11 and table.extra_blocks_for(33) == 13
    host = list(range(100, 111))
    pairs = table.swap_in(host)
    assert [h for h, _ in pairs] == host
    assert [d for _, d in pairs] == table.held_blocks()
    assert table.num_released == [0, 5]
    table.free()
    assert pool.num_free_blocks == 64


def test_a_cached_prefix_needs_only_the_window_blocks() -> None:
    pool = BlockAllocator(64, enable_prefix_caching=True)
    tokens = list(range(29))
    first = _computed(pool, tokens)
    first.free()
    second = BlockTable(pool, BLOCK, WINDOWS)
    # 7 full blocks are cached; the token at 28 reads 21..28: window blocks 5 and 6
    assert second.match_prefix([*tokens, 99, 98, 97, 96, 95]) == 28
    assert second.num_released == [0, 5]
    assert len(second.held_blocks()) == 7 + 2
    second.free()
    assert pool.num_free_blocks == 64


def test_a_prefix_whose_window_blocks_were_evicted_is_not_reused() -> None:
    """The window group's early blocks (freed first, so evicted first) are gone while the
    global group's remain: a short prefix would read them, so it is not taken; the long one
    reads only later window blocks, still cached."""
    pool = BlockAllocator(16, enable_prefix_caching=True)
    tokens = list(range(29))
    first = _computed(pool, tokens)  # 8 + 8 blocks; 7 + 7 registered, window 0-4 freed
    first.free()
    pool.free(pool.allocate(2 + 5))  # the two unregistered blocks, then window blocks 0-4
    short = BlockTable(pool, BLOCK, WINDOWS)
    assert short.match_prefix([*tokens[:13], 99]) == 0
    assert short.held_blocks() == []
    long = BlockTable(pool, BLOCK, WINDOWS)
    assert long.match_prefix([*tokens, 99]) == 28
    long.free()
    assert pool.num_free_blocks == 16


def test_the_ranks_get_every_group_in_an_update() -> None:
    pool = BlockAllocator(64)
    table = BlockTable(pool, BLOCK, WINDOWS)
    table.ensure_capacity(8)
    table.mark_synced()
    table.ensure_capacity(12)
    kept, appended = table.take_update()  # type: ignore[misc]
    assert kept == 2 and appended == [table.tables[0][2:], table.tables[1][2:]]
    assert table.take_update() is None


def test_the_longest_sequence_a_pool_holds() -> None:
    # one group: a block per 4 tokens
    assert max_sequence_tokens(10, BLOCK, [None], 6) == 40
    # a window group holds at most ceil((8 - 1 + 6) / 4) + 1 = 5 blocks
    assert max_sequence_tokens(10, BLOCK, [None, WINDOW], 6) == 20  # 5 + 5
    assert max_sequence_tokens(30, BLOCK, [None, WINDOW], 6) == 100  # 25 + 5
    assert max_sequence_tokens(10, BLOCK, [WINDOW, WINDOW], 6) == sys.maxsize
    assert max_sequence_tokens(9, BLOCK, [WINDOW, WINDOW], 6) == 0
