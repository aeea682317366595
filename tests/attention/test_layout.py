"""`build_step_layout`: the one validated view of a step that the model runner computes and every
builder reads, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from attnserve.attention import as_decode_rows, build_step_layout
from attnserve.worker.graphs import pad_for_graph


def test_mixed_step_positions_slots_and_table() -> None:
    # a 3-token prompt, a chunk of 2 after 4 cached tokens, then a decode after 5 (block size 4)
    layout = build_step_layout([[9], [2, 6], [4, 1]], [0, 4, 5], [3, 2, 1], block_size=4)
    assert (layout.num_prefills, layout.num_prefill_tokens, layout.num_decode_tokens) == (2, 5, 1)
    assert layout.token_seq.tolist() == [0, 0, 0, 1, 1, 2]
    assert layout.token_pos.tolist() == [0, 1, 2, 4, 5, 5]
    assert layout.slot_mapping.tolist() == [36, 37, 38, 24, 25, 5]
    assert layout.query_start_loc.tolist() == [0, 3, 5, 6]
    assert layout.seq_lens.tolist() == [3, 6, 6]
    assert layout.block_table.tolist() == [[9, 0], [2, 6], [4, 1]]


def test_a_one_token_prompt_is_a_prefill() -> None:
    layout = build_step_layout([[0], [1]], [0, 3], [1, 1], block_size=4)
    assert (layout.num_prefills, layout.num_decode_tokens) == (1, 1)


@pytest.mark.parametrize(
    ("block_tables", "context_lens", "query_lens", "message"),
    [
        ([[0]], [0, 1], [1], "one entry per sequence"),
        ([[0]], [0], [0], "query_len must be >= 1"),
        ([[0]], [10], [10], "need 2 blocks"),
        ([[0], [1]], [3, 0], [1, 4], "prefill after a decode"),
        ([[-1]], [0], [2], "block ids must be >= 0"),
    ],
)
def test_bad_batches_are_rejected(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        build_step_layout(block_tables, context_lens, query_lens, block_size=16)


def test_each_kv_cache_group_has_its_own_table_and_slots() -> None:
    layout = build_step_layout([[3, 4], [5]], [2, 0], [3, 2], 4, [[[7, 8], [9]]])
    group = layout.for_group(1)
    assert group.block_table.tolist() == [[7, 8], [9, 0]]
    assert group.slot_mapping.tolist() == [30, 31, 32, 36, 37]
    assert layout.slot_mapping.tolist() == [14, 15, 16, 20, 21]
    assert layout.for_group(0) is layout
    assert group.token_pos.tolist() == layout.token_pos.tolist()
    rows = as_decode_rows(layout).for_group(1)
    assert rows.block_table.tolist() == [[7, 8]] * 3 + [[9, 0]] * 2
    with pytest.raises(ValueError, match="no KV-cache group 2"):
        layout.for_group(2)
    with pytest.raises(ValueError, match="as long as group 0's"):
        build_step_layout([[3, 4]], [0], [5], 4, [[[7]]])


def test_a_padded_graph_step_pads_every_group() -> None:
    layout = build_step_layout([[3], [5]], [1, 2], [1, 1], 4, [[[6], [7]]])
    padded = pad_for_graph(layout, 4).for_group(1)
    assert padded.block_table.tolist() == [[6], [7], [0], [0]]
    assert padded.slot_mapping.tolist() == [25, 30, -1, -1]
