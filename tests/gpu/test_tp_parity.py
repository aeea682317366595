"""Tensor parallelism on two GPUs of one host (NCCL): fp32 greedy tokens at TP=2 equal TP=1's
and HF transformers' on the same dummy weights (the seeded init gives every rank its shard of
the same full weights). Qwen3-0.6B's shape: 16 query / 8 KV heads, so both degrees divide it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attnserve import LLM
from tests.gpu.reference import ENGINE, MODEL, Reference, engine_tokens

pytestmark = pytest.mark.cuda(gpus=2)


def _tokens(tensor_parallel_size: int, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(MODEL, dtype="float32", tensor_parallel_size=tensor_parallel_size, **ENGINE)
    try:
        return engine_tokens(llm, prompts)
    finally:
        llm.shutdown()


def test_tp2_fp32_tokens_equal_tp1_and_hf(hf_reference: Callable[[str], Reference]) -> None:
    reference = hf_reference("float32")
    tp1 = _tokens(1, reference.prompts)
    tp2 = _tokens(2, reference.prompts)
    assert tp2 == tp1
    assert tp1 == reference.tokens
