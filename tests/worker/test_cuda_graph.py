"""Graph buckets and the padded decode step that captured graphs read (CPU-checkable parts;
capture and replay themselves run in tests/gpu/test_hf_parity.py on the GPU)."""

from __future__ import annotations

import pytest
import torch

from attnserve.attention.backends.layout import pad_decode_step
from attnserve.worker.cuda_graph import capture_sizes


@pytest.mark.parametrize(
    ("max_num_seqs", "sizes"),
    [(1, [1]), (4, [1, 2, 4]), (10, [1, 2, 4, 8, 10]), (24, [1, 2, 4, 8, 16, 24])],
)
def test_capture_sizes_cover_every_batch(max_num_seqs: int, sizes: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == sizes


def test_padded_decode_step_puts_padding_nowhere() -> None:
    step = pad_decode_step([[7, 3], [5]], [17, 2], 4, block_size=16)
    assert step.block_table.tolist() == [[7, 3], [5, 0], [0, 0], [0, 0]]
    assert step.seq_lens.tolist() == [18, 3, 1, 1]
    assert step.slot_mapping.tolist() == [3 * 16 + 1, 5 * 16 + 2, -1, -1]
    assert step.block_table.dtype == torch.int64


@pytest.mark.parametrize(
    ("tables", "contexts", "padded", "message"),
    [
        ([[0]], [1, 2], 4, "1 block tables and 2 context lengths"),
        ([[0], [1]], [1, 1], 1, "padded to 1"),
        ([[0]], [0], 2, "cached context"),
        ([[0]], [16], 2, "a block for its new token"),
    ],
)
def test_padded_decode_step_rejects_bad_steps(
    tables: list[list[int]], contexts: list[int], padded: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        pad_decode_step(tables, contexts, padded, block_size=16)
