"""FLASHINFER's metadata builder on the CPU (it needs no flashinfer until a wrapper is planned):
the CSR page metadata of a mixed step and of a padded CUDA-graph decode step, computed by hand."""

from __future__ import annotations

import torch

from attnserve.attention.backends.flashinfer import FlashInferMetadataBuilder


def _ints(tensor: torch.Tensor) -> list[int]:
    assert tensor.dtype == torch.int32
    return [int(v) for v in tensor]


def test_mixed_step_csr() -> None:
    builder = FlashInferMetadataBuilder(block_size=4, device="cpu")
    # a prefill of 6 new tokens after 3 cached (9 tokens: 3 pages), a 5-token prompt (2 pages),
    # then decodes at contexts 4 (5 tokens: 2 pages) and 2 (3 tokens: 1 page)
    meta = builder.build([[3, 1, 8], [6, 4], [7, 0], [2]], [3, 0, 4, 2], [6, 5, 1, 1])
    prefill, decode = meta.prefill, meta.decode
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
    assert meta.slot_mapping.tolist()[:3] == [3 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1]
    assert meta.slot_mapping.tolist()[-2:] == [0 * 4 + 0, 2 * 4 + 2]


def test_graph_decode_step_is_padded_with_one_token_sequences() -> None:
    builder = FlashInferMetadataBuilder(block_size=4, device="cpu")
    builder.init_cuda_graph_buffers(max_num_seqs=4, max_blocks_per_seq=3)
    meta = builder.build_for_cuda_graph(4, [[5, 2], [9]], [6, 1])
    decode = meta.decode
    assert decode is not None and meta.prefill is None and meta.graph_size == 4
    assert _ints(decode.kv_indptr) == [0, 2, 3, 4, 5]
    assert _ints(decode.kv_indices) == [5, 2, 9, 0, 0]  # padding reads block 0 ...
    assert _ints(decode.kv_last_page_len) == [3, 2, 1, 1]
    assert meta.slot_mapping.tolist() == [2 * 4 + 2, 9 * 4 + 1, -1, -1]  # ... and writes nothing
