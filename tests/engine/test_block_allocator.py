"""BlockAllocator and BlockTable: allocation, sharing, freeing, and running out."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.engine.core.block_allocator import BlockAllocator, OutOfBlocksError
from attnserve.engine.core.block_table import BlockTable


def test_allocate_free_roundtrip() -> None:
    pool = BlockAllocator(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_running_out_is_reported_and_takes_nothing() -> None:
    pool = BlockAllocator(2)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 of 2 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_shared_block_is_freed_by_its_last_holder() -> None:
    pool = BlockAllocator(2)
    (block,) = pool.allocate(1)
    pool.share([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_double_free_and_bad_ids_are_value_errors() -> None:
    pool = BlockAllocator(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([block])
    with pytest.raises(ValueError, match="out of range"):
        pool.share([7])


def test_a_block_freed_twice_in_one_call_changes_nothing() -> None:
    pool = BlockAllocator(3)
    first, second = pool.allocate(2)
    with pytest.raises(ValueError, match="freed more often than held"):
        pool.free([second, first, first])
    assert pool.ref_count(first) == pool.ref_count(second) == 1 and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="out of range"):
        pool.free([first, -1])
    pool.free([first, second])
    assert pool.num_free_blocks == 3 and sorted(pool.allocate(3)) == [0, 1, 2]


def test_block_table_grows_and_frees() -> None:
    pool = BlockAllocator(8)
    table = BlockTable(pool, block_size=4)
    table.ensure_capacity(9)
    assert len(table.blocks) == 3
    table.free()
    assert pool.num_free_blocks == 8


def test_block_table_out_of_blocks_keeps_what_it_had() -> None:
    pool = BlockAllocator(2)
    table = BlockTable(pool, block_size=4)
    table.ensure_capacity(4)
    with pytest.raises(OutOfBlocksError):
        table.ensure_capacity(20)
    assert len(table.blocks) == 1 and pool.num_free_blocks == 1


OPS = st.tuples(st.sampled_from(["grow", "share", "free"]), st.integers(0, 40))


@settings(max_examples=60, deadline=None)
@given(st.lists(OPS, max_size=60))
def test_random_streams_never_leak(ops: list[tuple[str, int]]) -> None:
    pool = BlockAllocator(16)
    tables: list[BlockTable] = []
    for op, n in ops:
        if op == "grow":
            table = BlockTable(pool, block_size=4)
            with contextlib.suppress(OutOfBlocksError):
                table.ensure_capacity(n)
            tables.append(table)
        elif op == "share" and tables:
            source = tables[n % len(tables)]
            twin = BlockTable(pool, block_size=4)
            pool.share(source.blocks)
            twin.blocks = list(source.blocks)
            tables.append(twin)
        elif op == "free" and tables:
            tables.pop(n % len(tables)).free()
        holders = {b: sum(t.blocks.count(b) for t in tables) for b in range(16)}
        assert all(pool.ref_count(b) == holders[b] for b in range(16))
        assert pool.num_free_blocks == sum(1 for b in range(16) if holders[b] == 0)
