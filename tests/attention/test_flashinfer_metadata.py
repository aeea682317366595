"""FLASHINFER's page metadata on the CPU (it needs no flashinfer until a wrapper is planned): the
CSR groups of a mixed step and of a padded CUDA-graph decode step against values computed by
hand, and the decode kernel choice per GQA group size."""

from __future__ import annotations

import torch

from attnserve.attention import AttentionSpec, build_step_layout
from attnserve.attention.backends.flashinfer import paged_groups, use_tensor_cores
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


def test_graph_decode_step_is_padded_with_one_token_sequences() -> None:
    layout = build_step_layout([[5, 2], [9]], [6, 1], [1, 1], 4)
    prefill, decode = paged_groups(pad_for_graph(layout, 4), 4, torch.device("cpu"))
    assert decode is not None and prefill is None
    assert _ints(decode.qo_indptr) == [0, 1, 2, 3, 4]
    assert _ints(decode.kv_indptr) == [0, 2, 3, 4, 5]
    assert _ints(decode.kv_indices) == [5, 2, 9, 0, 0]  # padding reads block 0
    assert _ints(decode.kv_last_page_len) == [3, 2, 1, 1]


def test_tensor_core_decode_from_groups_of_four() -> None:
    def spec(num_heads: int, num_kv_heads: int) -> AttentionSpec:
        return AttentionSpec(num_heads, num_kv_heads, 128, torch.bfloat16)

    assert not use_tensor_cores(spec(16, 8))  # Qwen3-0.6B
    assert use_tensor_cores(spec(32, 8))  # Llama-3-8B
    assert use_tensor_cores(spec(32, 1)) and not use_tensor_cores(spec(12, 4))
