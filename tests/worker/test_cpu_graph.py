"""CPU graphs in the engine (`CPUGraphRunner`): the default model (GGUF kept packed) captures a
graph per bucket on the bucket's first step, and its decode steps, captured and replayed, draw
the same tokens with the same log-probs, bit for bit, as eager steps (a replay makes the same
native calls on the same values); a model whose forward computes with torch ops captures none
and runs eagerly."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.model.quantization.gguf_cpu import native_library

pytestmark = pytest.mark.skipif(native_library() is None, reason="no AVX2 CPU or C compiler")

PROMPTS = [
    "What is the capital of France?",
    "Name a colour.",
    "Write a haiku about the sea.",
    "Count to five.",
    "Give me three tips for learning a new language.",
    "What is 2 + 2?",
]


@pytest.fixture(scope="module")
def eager_llm() -> Iterator[LLM]:
    llm = LLM(device="cpu", max_model_len=1024, enforce_eager=True)
    yield llm
    llm.shutdown()


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.executor.driver_runner


def _decode(llm: LLM) -> list[tuple[list[int], list[float]]]:
    # different lengths: the batch shrinks 6 -> 1 over the steps (buckets 6, 5, ... 1)
    params = [
        SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=1)
        for i in range(len(PROMPTS))
    ]
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    outputs = [o.outputs[0] for o in llm.chat(chats, params, use_tqdm=False)]
    return [
        (list(o.token_ids), [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)])
        for o in outputs
    ]


def test_replayed_decodes_equal_eager_ones(
    default_llm: LLM, eager_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    graphs = _runner(default_llm).graphs
    assert _runner(eager_llm).graphs is None
    sizes: list[int] = []
    replay: Callable[..., Any] = graphs.run

    def counted(token_ids: Any, layout: Any, carried: Any = None) -> Any:
        sizes.append(layout.num_seqs)
        return replay(token_ids, layout, carried)

    monkeypatch.setattr(graphs, "run", counted)
    replayed = _decode(default_llm)
    assert set(sizes) == {1, 2, 3, 4, 5, 6}  # every decode step of the run came from a graph
    # every size its own bucket to 16 (no padded rows), then 24, 32, 48, 64
    assert graphs.sizes == [*range(1, 17), 24, 32, 48, 64]
    assert sorted(graphs.graphs) == [1, 2, 3, 4, 5, 6]  # each size the run had, captured
    assert all(graph.num_calls > 0 for graph, _ in graphs.graphs.values())
    assert replayed == _decode(eager_llm)
    assert _decode(default_llm) == replayed  # replays only, this time


def test_a_model_computing_with_torch_ops_runs_eagerly(tiny_llama_dir: Path) -> None:
    """A float32 checkpoint: its embedding and linear layers are torch ops, so the first
    decode step's capture is refused, reruns eagerly, and no bucket is left."""
    params = SamplingParams(temperature=0, max_tokens=4)
    eager = LLM(model=str(tiny_llama_dir), device="cpu", max_model_len=64, enforce_eager=True)
    expected = eager.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    eager.shutdown()
    llm = LLM(model=str(tiny_llama_dir), device="cpu", max_model_len=64)
    try:
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected
        graphs = _runner(llm).graphs
        assert graphs.graphs == {} and graphs.max_num_seqs == 0
    finally:
        llm.shutdown()


def test_buckets_stop_at_max_num_seqs() -> None:
    llm = LLM(device="cpu", max_model_len=256, max_num_seqs=3)
    try:
        assert _runner(llm).graphs.sizes == [1, 2, 3]
    finally:
        llm.shutdown()


def test_a_new_thread_count_captures_the_graphs_again(default_llm: LLM) -> None:
    graphs = _runner(default_llm).graphs
    before = _decode(default_llm)
    threads = torch.get_num_threads()
    captured = dict(graphs.graphs)
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert _decode(default_llm) == before  # the kernels' results do not depend on threads
        assert all(graphs.graphs[size][0] is not captured[size][0] for size in captured)
    finally:
        torch.set_num_threads(threads)


def test_a_batch_past_sixteen_replays_a_padded_bucket(default_llm: LLM, eager_llm: LLM) -> None:
    """21 sequences run in the 24-sequence bucket (3 padded rows): the same greedy tokens as the
    eager engine's."""
    rng = random.Random(1)
    prompts: list[Any] = [
        {"prompt_token_ids": [rng.randrange(1000) for _ in range(rng.randrange(5, 30))]}
        for _ in range(21)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=3 + i % 3, ignore_eos=True) for i in range(21)
    ]

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    replayed = tokens(default_llm)
    assert 24 in _runner(default_llm).graphs.graphs
    assert replayed == tokens(eager_llm)
