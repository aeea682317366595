"""FLASHINFER's page metadata on the CPU (it needs no flashinfer until a wrapper is planned): the
CSR groups of a mixed step and of a padded CUDA-graph decode step, and the slot writes, against
values computed by hand."""

from __future__ import annotations

import torch

from attnserve.attention import build_step_layout
from attnserve.attention.backends.flashinfer import SlotWrites, paged_groups
from attnserve.worker.graphs import pad_for_graph


def _ints(tensor: torch.Tensor) -> list[int]:
    assert tensor.dtype == torch.int32
    return [int(v) for v in tensor]


def test_mixed_step_csr() -> None:
    # a prefill of 6 new tokens after 3 cached (9 tokens: 3 pages), a 5-token prompt (2 pages),
    # then decodes at contexts 4 (5 tokens: 2 pages) and 2 (3 tokens: 1 page)
    layout = build_step_layout([[3, 1, 8], [6, 4], [7, 0], [2]], [3, 0, 4, 2], [6, 5, 1, 1], 4)
    prefill, decode = paged_groups(layout, 4, torch.device("cpu"))
    assert prefill is not None and decode is not None
    assert prefill.token_slice == slice(0, 11) and decode.token_slice == slice(11, 13)
    assert _ints(prefill.qo_indptr) == [0, 6, 11]
    assert _ints(prefill.kv_indptr) == [0, 3, 5]
    assert _ints(prefill.kv_indices) == [3, 1, 8, 6, 4]
    assert _ints(prefill.kv_last_page_len) == [1, 1]
    assert _ints(decode.qo_indptr) == [0, 1, 2]
    assert _ints(decode.kv_indptr) == [0, 2, 3]
    assert _ints(decode.kv_indices) == [7, 0, 2]
    assert _ints(decode.kv_last_page_len) == [1, 3]
    writes = SlotWrites.from_slot_mapping(layout.slot_mapping, 4)
    assert writes.blocks.tolist()[:3] == [3, 1, 1] and writes.offsets.tolist()[:3] == [3, 0, 1]
    assert writes.blocks.tolist()[-2:] == [0, 2] and writes.offsets.tolist()[-2:] == [0, 2]
    assert not writes.keep_old.any() and writes.source.tolist() == list(range(13))


def test_graph_decode_step_is_padded_with_one_token_sequences() -> None:
    layout = build_step_layout([[5, 2], [9]], [6, 1], [1, 1], 4)
    prefill, decode = paged_groups(pad_for_graph(layout, 4), 4, torch.device("cpu"))
    assert decode is not None and prefill is None
    assert _ints(decode.qo_indptr) == [0, 1, 2, 3, 4]
    assert _ints(decode.kv_indptr) == [0, 2, 3, 4, 5]
    assert _ints(decode.kv_indices) == [5, 2, 9, 0, 0]  # padding reads block 0 ...
    assert _ints(decode.kv_last_page_len) == [3, 2, 1, 1]
    writes = SlotWrites.from_slot_mapping(pad_for_graph(layout, 4).slot_mapping, 4)
    # ... and writes nothing: padding rewrites the first real token's slot with its own values
    assert writes.source.tolist() == [0, 1, 0, 0]
    assert writes.blocks.tolist() == [2, 9, 2, 2] and writes.offsets.tolist() == [2, 1, 2, 2]
