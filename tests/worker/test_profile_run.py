"""The profile run: its batch fills the scheduler's limits, and running it touches neither the
real KV cache nor what the engine generates afterwards (the CUDA memory measurement around it
runs on the GPU only). The warm-up plans: the longest prompt a step holds, fresh and after a
cached block, and running them on the real cache at start-up changes nothing generated later."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.attention import bind_kv_caches, build_step_layout
from attnserve.worker.profile_run import PROFILE_SAMPLING, profile_plan, warm_up_plans


@pytest.mark.parametrize(
    ("max_num_seqs", "max_tokens", "max_model_len", "lengths"),
    [
        (4, 10, 64, [3, 3, 2, 2]),  # every sequence, the tokens spread over them
        (256, 3, 64, [1, 1, 1]),  # fewer tokens than sequences: one token each
        (2, 100, 8, [8, 8]),  # sequences full at max_model_len: fewer tokens than the budget
        (1, 8192, 8192, [8192]),
    ],
)
def test_profile_plan_fills_the_limits(
    max_num_seqs: int, max_tokens: int, max_model_len: int, lengths: list[int]
) -> None:
    plan = profile_plan(max_num_seqs, max_tokens, max_model_len, block_size=4)
    assert plan.num_new_tokens == lengths
    seqs = plan.new_seqs
    # the first continues a chunked prefill: a block of context where the model length allows
    assert seqs[0].num_computed_tokens == min(4, max_model_len - lengths[0])
    for seq in seqs:
        assert seq.num_computed_tokens == 0 or seq is seqs[0]
        assert seq.block_ids == [0] * -(-len(seq.token_ids) // 4)
        assert seq.sampling is PROFILE_SAMPLING
    assert len({seq.seq_id for seq in seqs}) == len(seqs) and all(s.seq_id < 0 for s in seqs)
    assert PROFILE_SAMPLING.top_k > 0 and PROFILE_SAMPLING.top_p < 1


@pytest.mark.parametrize(
    "limits", [(0, 8, 8, 16), (4, 0, 8, 16), (4, 8, 0, 16), (4, 8, 8, 0)], ids=str
)
def test_profile_plan_rejects_empty_limits(limits: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        profile_plan(*limits)


def test_profile_run_leaves_cache_and_outputs_alone(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    before = llm.generate(prompts, greedy, use_tqdm=False)
    runner = llm.llm_engine.executor.driver_runner
    real = runner.cache_engine
    caches = [cache.clone() for cache in real.kv_caches]
    del runner.cache_engine  # as at start-up, where the profile run comes before the cache
    runner.profile_run(max_num_seqs=4, max_num_batched_tokens=40)
    assert runner.cache_engine.num_blocks == 1
    assert all(torch.equal(a, b) for a, b in zip(caches, real.kv_caches, strict=True))
    runner.cache_engine = real
    bind_kv_caches(runner.model, real.kv_caches)
    after = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


@pytest.mark.parametrize(
    ("max_tokens", "max_model_len", "length"), [(8192, 40960, 8192), (8192, 100, 96), (3, 64, 3)]
)
def test_warm_up_plans_hold_the_longest_prompt_a_step_can(
    max_tokens: int, max_model_len: int, length: int
) -> None:
    fresh, chunk = warm_up_plans(max_tokens, max_model_len, block_size=4)
    for plan, context in ((fresh, 0), (chunk, 4)):
        (seq,) = plan.new_seqs
        assert plan.num_new_tokens == [length] and seq.num_computed_tokens == context
        assert len(seq.token_ids) == context + length
        assert seq.block_ids == [0] * -(-(context + length) // 4)
        assert seq.sampling is not None and seq.sampling.temperature == 0
        layout = build_step_layout([seq.block_ids], [context], [length], 4)
        assert layout.num_prefills == 1  # a valid prompt step, prefill path
    assert warm_up_plans(8192, 5, block_size=4) == []  # no prompt of 2+ tokens fits


def test_warm_up_on_the_real_cache_changes_nothing_generated_after(tiny_llama_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [5, 9, 2, 7, 1, 4, 4, 6, 2]]
    reference = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    runner = llm.llm_engine.executor.driver_runner
    for plan in warm_up_plans(40, 64, runner.cache_config.block_size):  # as on CUDA
        runner.run_once(plan)
    assert not runner.input_batch.states  # the start-up sequences are dropped
    assert any(cache[0].abs().sum() > 0 for cache in runner.cache_engine.kv_caches)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
