"""FLASH_ATTN's metadata (built on the CPU; the operator runs on CUDA 9.0+ only) against values
computed by hand, its layout as FlashAttention's paged k/v views, and why it (or FLASHINFER,
whose library is just as just-in-time) is unavailable: not installed, or installed broken."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from attnserve.attention import (
    AttentionMetadataBuilder,
    AttentionSpec,
    build_step_layout,
    get_attn_backend,
    get_backend_cls,
)
from attnserve.attention.backends.utils import import_failure
from attnserve.worker.graphs import pad_for_graph

BLOCK = 4


def _builder() -> AttentionMetadataBuilder:
    spec = AttentionSpec(4, 2, 64, torch.bfloat16, block_size=BLOCK)
    return get_backend_cls("FLASH_ATTN").get_builder_cls()(spec, "cpu")


def test_one_varlen_call_covers_prefills_and_decodes() -> None:
    # a prefill of 6 new tokens after 3 cached, a 5-token prompt, decodes at contexts 4 and 2
    layout = build_step_layout([[3, 1, 8], [6, 4], [7, 0], [2]], [3, 0, 4, 2], [6, 5, 1, 1], BLOCK)
    meta = _builder().build(layout)
    assert meta.query_start_loc.tolist() == [0, 6, 11, 12, 13]
    assert meta.seq_lens.tolist() == [9, 5, 5, 3]  # seqused_k: context + new
    assert meta.block_table.dtype == torch.int32
    assert meta.block_table[:, :2].tolist() == [[3, 1], [6, 4], [7, 0], [2, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (6, 9)
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens) == (2, 11, 2)


def test_graph_metadata_reads_fixed_buffers_planned_for_the_longest_context() -> None:
    builder = _builder()
    builder.init_graph_buffers(max_num_seqs=8, max_blocks_per_seq=5)
    layout = pad_for_graph(build_step_layout([[5, 2], [9]], [6, 1], [1, 1], BLOCK), 4)
    meta = builder.build_for_graph(layout)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [7, 2, 1, 1]
    assert meta.block_table[:2, :2].tolist() == [[5, 2], [9, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (1, 5 * BLOCK)
    assert meta.slot_mapping.tolist()[:2] == [2 * BLOCK + 2, 9 * BLOCK + 1]


def test_kv_cache_halves_are_flash_attention_paged_k_and_v() -> None:
    backend = get_backend_cls("FLASH_ATTN")
    cache = torch.zeros(backend.get_kv_cache_shape(3, BLOCK, 2, 64))
    assert cache[:, 0].shape == (3, BLOCK, 2, 64)  # (num_pages, page_size, Hkv, D)
    assert backend.get_kv_cache_block_dim() == 0


def test_unavailable_without_flash_attn_4(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend_cls("FLASH_ATTN")
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name.startswith("flash_attn") else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert "flash-attn-4 is not installed" in (backend.unavailable_reason() or "")
    with pytest.raises(ValueError, match="FLASH_ATTN cannot serve"):
        get_attn_backend(AttentionSpec(4, 2, 64, torch.bfloat16), "FLASH_ATTN")


def test_a_library_that_fails_to_import_is_a_reason_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_kernel_library.py").write_text("raise RuntimeError('no CTK flavor')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reason = import_failure("broken_kernel_library")
    assert reason is not None and "RuntimeError: no CTK flavor" in reason
    assert import_failure("json") is None


def test_flashinfer_that_fails_to_import_is_unavailable_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend_cls("FLASHINFER")
    module = sys.modules[backend.__module__]
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return object() if name == "flashinfer" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(module, "import_failure", lambda name: f"{name} is broken")
    monkeypatch.setenv("ATTNSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    if module._TRITON_ERROR is not None:
        pytest.skip(module._TRITON_ERROR)
    assert backend.unavailable_reason() == "flashinfer is broken"
    # its JIT cache goes into attnserve's cache, set before flashinfer's import
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "kernels" / "flashinfer")
