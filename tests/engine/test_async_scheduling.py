"""Async scheduling (a step launched before the previous step's tokens are read back) must not
change what any request gets: the same tokens and finish reasons as the synchronous engine, and
the same log-probabilities up to float rounding (a sequence that finished runs one wasted step,
so batches, and with a small token budget the prefill chunks, can differ), whatever the
sampling features and however the scheduler preempts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from attnserve import LLM, SamplingParams

MIXED = [
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=8, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=10, logprobs=2, min_tokens=2),
    SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7, 11, 19]),
]


def _summary(llm: LLM, prompts: list[list[int]]) -> tuple[list[Any], list[float]]:
    """Tokens and finish reasons per completion; every log-probability, flattened."""
    outputs = llm.generate(prompts, MIXED, use_tqdm=False)
    completions = [c for out in outputs for c in out.outputs]
    logprobs = [
        value
        for c in completions
        for entry in c.logprobs or []
        for _, value in sorted((t, lp.logprob) for t, lp in entry.items())
    ]
    return [(c.token_ids, c.finish_reason) for c in completions], logprobs


@pytest.mark.parametrize(
    "setup",
    [{}, {"kv_cache_memory_bytes": 14 * 4096, "block_size": 4}, {"max_num_batched_tokens": 8}],
    ids=["one-batch", "preempting", "chunked"],
)
def test_async_scheduling_changes_no_output(tiny_llama_dir: Path, setup: dict[str, Any]) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 380) for _ in range(n)] for n in (6, 17, 3, 25, 11)]
    sync = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=False, **setup)
    expected, expected_logprobs = _summary(sync, prompts)
    overlapped = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=True, **setup)
    got, logprobs = _summary(overlapped, prompts)
    assert got == expected
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert overlapped.llm_engine.stats()["kv_cache_usage"] == 0
