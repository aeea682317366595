"""Graph buckets and the padded decode layout that captured graphs read (the CPU-checkable
parts; capture and replay run in tests/gpu/test_hf_parity.py on the GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnserve.attention import build_step_layout
from attnserve.worker.graphs import pad_for_graph
from attnserve.worker.graphs.base import capture_sizes


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, [1]), (4, [1, 2, 4]), (10, [1, 2, 4, 8, 10]), (24, [1, 2, 4, 8, 16, 24])],
)
def test_capture_sizes_cover_every_batch(max_num_seqs: int, sizes: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == sizes


def test_capture_sizes_thin_out_above_256() -> None:
    sizes = capture_sizes(1000)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 1000
    assert sizes[sizes.index(248) : sizes.index(256) + 3] == [248, 256, 272, 288]
    assert sizes[sizes.index(480) : sizes.index(512) + 3] == [480, 496, 512, 544, 576]
    steps = [(b - a) / b for a, b in itertools.pairwise(sizes) if a >= 128]
    assert max(steps) < 0.07  # above 128 a step's padding to its bucket stays under 7%


def test_padded_decode_layout_puts_padding_nowhere() -> None:
    layout = build_step_layout([[7, 3], [5]], [17, 2], [1, 1], block_size=16)
    padded = pad_for_graph(layout, 4)
    assert (padded.num_prefills, padded.num_decode_tokens, padded.num_seqs) == (0, 4, 4)
    assert padded.block_table.tolist() == [[7, 3], [5, 0], [0, 0], [0, 0]]
    assert padded.seq_lens.tolist() == [18, 3, 1, 1]
    assert padded.token_pos.tolist() == [17, 2, 0, 0]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.slot_mapping.tolist() == [3 * 16 + 1, 5 * 16 + 2, -1, -1]
    assert padded.block_table.dtype == torch.int64


@pytest.mark.parametrize(
    ("context_lens", "query_lens", "padded", "message"),
    [
        ([1, 1], [1, 1], 1, "padded to a decode-only step of 1"),
        ([0, 1], [3, 1], 4, "1 prefills"),
    ],
)
def test_padding_rejects_steps_that_are_not_decodes_within_the_bucket(
    context_lens: list[int], query_lens: list[int], padded: int, message: str
) -> None:
    layout = build_step_layout([[0], [1]], context_lens, query_lens, block_size=16)
    with pytest.raises(ValueError, match=message):
        pad_for_graph(layout, padded)
