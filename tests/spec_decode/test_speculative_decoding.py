"""Speculative decoding (n-gram drafts) changes no output: each engine configuration's tokens
and log-probabilities with speculation equal the same configuration's without, greedy and
seeded, while drafts are verified and accepted (the counts say so, so no case passes by never
speculating).

The configurations are the paths a verify step meets: continuous batching of sequences with and
without drafts, prefix caching off, chunked prefill, preemption by recompute and by swap, the
engine core in a process of its own, synchronous scheduling, tensor parallelism (gloo, two
processes), parallel sampling and stop strings; the embedded default model on prompts that ask
to repeat a text is the case where most drafts are right.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from attnserve import LLM, SamplingParams
from attnserve.spec_decode.draft_model_proposer import DraftModelProposer
from attnserve.step_types import StepPlan, StepResults
from attnserve.worker.model_runner import ModelRunner

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip
PATTERN = [5, 6, 7, 8, 9, 10, 11, 12]
# prompts that repeat themselves (drafts from the prompt) of several lengths, and one that does not
PROMPTS = [PATTERN * 3, PATTERN * 2 + [5, 6], [40 + i for i in range(19)], PATTERN[:5] * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
# two sequences end early, so the batch of four shrinks to two
STAGGERED = [dataclasses.replace(GREEDY, max_tokens=n) for n in (6, 10, 40, 40)]
Outputs = list[tuple[list[int], Any]]


def generate(
    model: str, prompts: list[Any], params: SamplingParams | list[SamplingParams], **engine: Any
) -> tuple[Outputs, dict[str, float]]:
    """Each prompt's first completion (tokens, log-probabilities) from a fresh engine (fp32, on
    the CPU unless `engine` names a device), and the engine's stats after."""
    llm = LLM(model, **{"device": "cpu", "dtype": "float32", **engine})
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], stats


def assert_same_outputs(got: Outputs, want: Outputs) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got, want, strict=True):
        assert (got_logprobs is None) == (want_logprobs is None)
        for got_row, want_row in zip(got_logprobs or [], want_logprobs or [], strict=True):
            assert got_row.keys() == want_row.keys()
            for token, value in want_row.items():
                assert got_row[token].logprob == pytest.approx(value.logprob, abs=1e-4)


def assert_speculated(stats: dict[str, float]) -> None:
    assert stats["spec_decode_num_drafts"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]


CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "batched": {},
    "no prefix caching": {"enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 12},
    "recompute preemption": {"kv_cache_memory_bytes": 40_000},
    "swap preemption": {"kv_cache_memory_bytes": 40_000, "preemption_mode": "swap"},
    "synchronous scheduling": {"async_scheduling": False},
    "engine core process": {"engine_core_process": True},
    "tensor parallel": {"tensor_parallel_size": 2},
}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_greedy_outputs_equal_without_speculation(tiny_llama_dir: Path, name: str) -> None:
    engine = CONFIGURATIONS[name]
    want, plain_stats = generate(str(tiny_llama_dir), PROMPTS, GREEDY, **engine)
    got, stats = generate(str(tiny_llama_dir), PROMPTS, GREEDY, speculative_config=SPEC, **engine)
    assert_same_outputs(got, want)
    assert_speculated(stats)
    assert "spec_decode_num_drafts" not in plain_stats
    if "kv_cache_memory_bytes" in engine:
        assert stats["num_preemptions"] > 0


def test_seeded_parallel_sampling_equals_without_speculation(tiny_llama_dir: Path) -> None:
    """Each output position's draw has its own seed, so a seeded request draws the same tokens
    however many of them were drafted; n = 2 forks each take their own."""
    params = SamplingParams(
        n=2, temperature=0.7, top_k=8, seed=11, max_tokens=20, ignore_eos=True, logprobs=1
    )
    model = str(tiny_llama_dir)
    llm_outputs = []
    for spec in (None, SPEC):
        llm = LLM(model, device="cpu", dtype="float32", speculative_config=spec)
        try:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.llm_engine.stats()
        finally:
            llm.shutdown()
        llm_outputs.append([[c.token_ids for c in o.outputs] for o in outputs])
    assert llm_outputs[1] == llm_outputs[0]
    assert_speculated(stats)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_steps_aside_for_a_large_batch(tiny_llama_dir: Path, method: str) -> None:
    """More sequences than `disable_by_batch_size`: no drafts while they run (a draft model
    only keeps its cache up)."""
    drafter = SPEC if method == "ngram" else {"model": str(tiny_llama_dir)}
    spec = {**drafter, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    got, stats = generate(str(tiny_llama_dir), PROMPTS, GREEDY, speculative_config=spec)
    want, _ = generate(str(tiny_llama_dir), PROMPTS, GREEDY)
    assert_same_outputs(got, want)
    assert stats["spec_decode_num_drafts"] == 0


def test_a_draft_model_leaves_steps_without_drafts_asynchronous(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the batch is too large to speculate, each step is launched before the draft takes
    in the step before it (as the engine reads that one back), and the draft takes every step
    in, in launch order; once two sequences are left they draft, and the outputs are as
    without speculation."""
    model = str(tiny_llama_dir)
    launched: list[StepPlan] = []  # the target's steps (the draft's passes are `draft_step`)
    taken_in: list[tuple[StepPlan, int]] = []  # each step the draft took in, and launches then
    execute_async, follow = ModelRunner.execute_async, DraftModelProposer.follow

    def launch(runner: ModelRunner, plan: StepPlan) -> Any:
        launched.append(plan)
        return execute_async(runner, plan)

    def take_in(proposer: DraftModelProposer, plan: StepPlan, results: StepResults) -> None:
        taken_in.append((plan, len(launched)))
        follow(proposer, plan, results)

    monkeypatch.setattr(ModelRunner, "execute_async", launch)
    monkeypatch.setattr(DraftModelProposer, "follow", take_in)
    spec = {"model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    got, stats = generate(model, PROMPTS, STAGGERED, speculative_config=spec)
    assert [plan for plan, _ in taken_in] == launched
    large = [i for i, plan in enumerate(launched) if len(plan.seq_ids) > 2]
    ahead = [i for i in large if taken_in[i][1] > i + 1]
    assert len(large) >= 6
    assert len(ahead) >= len(large) - 2
    assert stats["spec_decode_num_drafts"] > 0
    monkeypatch.undo()
    want, _ = generate(model, PROMPTS, STAGGERED)
    assert_same_outputs(got, want)


@pytest.mark.parametrize(
    "name", ["recompute preemption", "swap preemption", "engine core process", "tensor parallel"]
)
def test_a_draft_model_takes_in_the_steps_it_did_not_draft_in(
    tiny_llama_dir: Path, name: str
) -> None:
    """Steps while the batch is too large to draft, which the draft takes in late (preempted
    sequences among them, or in an engine-core process; tensor parallelism runs each step at
    once): once two sequences are left they draft, nearly always right (over the blocks the
    preemptions moved), and the outputs are as without speculation."""
    model = str(tiny_llama_dir)
    engine = CONFIGURATIONS[name]
    want, _ = generate(model, PROMPTS, STAGGERED, **engine)
    spec = {"model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    budget = engine.get("kv_cache_memory_bytes")
    # (no prompt counts as long, so they start in arrival order and the steps preempt)
    both = engine if budget is None else {**engine, "kv_cache_memory_bytes": 2 * budget,
                                          "long_prefill_token_threshold": 512}  # fmt: skip
    got, stats = generate(model, PROMPTS, STAGGERED, speculative_config=spec, **both)
    assert_same_outputs(got, want)
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_acceptance_rate"] > 0.9
    if budget is not None:
        assert stats["num_preemptions"] > 0


def test_max_tokens_and_stop_tokens_cut_accepted_drafts(tiny_llama_dir: Path) -> None:
    """A step may accept several tokens; the sequence still ends exactly at `max_tokens`, and at
    the first stop token among them."""
    want, _ = generate(str(tiny_llama_dir), PROMPTS, GREEDY)
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        got, _ = generate(str(tiny_llama_dir), PROMPTS, params, speculative_config=SPEC)
        assert [tokens for tokens, _ in got] == [tokens[:max_tokens] for tokens, _ in want]
    stop_token = want[1][0][-8]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token])
    got, stats = generate(str(tiny_llama_dir), PROMPTS, params, speculative_config=SPEC)
    for (tokens, _), (full, _) in zip(got, want, strict=True):
        end = full.index(stop_token) + 1 if stop_token in full else len(full)
        assert tokens == full[:end]
    assert_speculated(stats)


def test_the_default_model_repeats_a_text_with_the_same_tokens() -> None:
    """The embedded model asked to repeat a text: most drafts are right, the text and its
    log-probabilities equal those without speculation, and a stop string still ends it."""
    text = "The quick brown fox jumps over the lazy dog. The cat sat on the mat all day long."
    prompts = [f"Repeat this text exactly: {text}\n\n{text}\n\nAgain: "]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1, stop=["all day"])
    runs = []
    for spec in (None, SPEC):
        llm = LLM(device="cpu", max_model_len=512, speculative_config=spec)
        try:
            output = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
            runs.append((output, llm.llm_engine.stats()))
        finally:
            llm.shutdown()
    (plain, _), (speculated, stats) = runs
    assert speculated.text == plain.text
    assert plain.finish_reason == speculated.finish_reason == "stop"
    assert_same_outputs(
        [(speculated.token_ids, speculated.logprobs)], [(plain.token_ids, plain.logprobs)]
    )
    assert stats["spec_decode_acceptance_rate"] > 0.5


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_draft_model_changes_no_output(tiny_llama_dir: Path, name: str) -> None:
    """The target as its own draft (method "draft_model"): greedy outputs as without
    speculation, on every path; nearly every draft is accepted (the draft's one-token steps and
    the target's verify rows compute the same logits). A KV budget pays for both caches' blocks:
    twice the bytes hold the target's blocks of the run without speculation."""
    engine = CONFIGURATIONS[name]
    model = str(tiny_llama_dir)
    want, _ = generate(model, PROMPTS, GREEDY, **engine)
    spec = {"model": model, "num_speculative_tokens": 3}
    budget = engine.get("kv_cache_memory_bytes")
    speculative = engine if budget is None else {**engine, "kv_cache_memory_bytes": 2 * budget}
    got, stats = generate(model, PROMPTS, GREEDY, speculative_config=spec, **speculative)
    assert_same_outputs(got, want)
    assert_speculated(stats)
    assert stats["spec_decode_acceptance_rate"] > 0.9
    if budget is not None:
        assert stats["num_preemptions"] > 0


def test_a_draft_computes_a_cached_prefix_it_skipped(tiny_llama_dir: Path) -> None:
    """A batch too large to speculate runs first (the draft computes nothing for it); then a
    prompt sharing its prefix hits the target's prefix cache, whose blocks the draft's cache
    does not hold: the draft computes that prefix itself, and its drafts are right as ever
    (drafts over keys it never wrote would be wrong)."""
    model = str(tiny_llama_dir)
    spec = {"model": model, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    llm = LLM(model, device="cpu", dtype="float32", speculative_config=spec)
    prefix = [40 + (7 * i) % 23 for i in range(48)]  # three blocks of 16
    try:
        llm.generate([[*prefix, i] for i in range(4)], GREEDY, use_tqdm=False)
        skipped = llm.llm_engine.stats()
        output = llm.generate([[*prefix, 9, 9]], GREEDY, use_tqdm=False)[0].outputs[0]
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert skipped["spec_decode_num_drafts"] == 0
    assert stats["prefix_cache_hit_rate"] > 0
    want, _ = generate(model, [[*prefix, 9, 9]], GREEDY)
    assert output.token_ids == want[0][0]
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_acceptance_rate"] > 0.9


def test_another_draft_model_of_the_vocabulary(
    tiny_llama_dir: Path, head64_llama_dir: Path
) -> None:
    """A different random model of the same vocabulary drafts: seeded parallel sampling and
    greedy outputs are the target's without speculation."""
    model, draft = str(tiny_llama_dir), str(head64_llama_dir)
    spec = {"model": draft, "num_speculative_tokens": 2}
    want, _ = generate(model, PROMPTS, GREEDY)
    got, stats = generate(model, PROMPTS, GREEDY, speculative_config=spec)
    assert_same_outputs(got, want)
    assert stats["spec_decode_num_drafts"] > 0
    seeded = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    want, _ = generate(model, PROMPTS, seeded)
    got, _ = generate(model, PROMPTS, seeded, speculative_config=spec)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]


def test_a_draft_model_whose_drafts_fail_steps_aside(
    tiny_llama_dir: Path, head64_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another random model drafts for 96 tokens and is nearly never right: after a few rounds
    it pauses (16 steps, then 32, then 64), so it drafts in a few rounds of the 96 steps, and
    the outputs are the target's without speculation. While paused the draft computes nothing:
    its forward passes are its drafting rounds', not one a step."""
    model, draft = str(tiny_llama_dir), str(head64_llama_dir)
    spec = {"model": draft, "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    want, _ = generate(model, PROMPTS[:1], params)
    forwards = []
    draft_step = ModelRunner.draft_step  # the draft's passes (the target's are `execute`)
    monkeypatch.setattr(
        ModelRunner,
        "draft_step",
        lambda runner, plan, *args: forwards.append(plan) or draft_step(runner, plan, *args),
    )
    got, stats = generate(model, PROMPTS[:1], params, speculative_config=spec)
    assert_same_outputs(got, want)
    assert stats["spec_decode_acceptance_rate"] < 0.1
    assert 0 < stats["spec_decode_num_drafts"] <= 16
    # three a drafting round, and a round whose drafts are dropped as a pause starts; following
    # every step would take at least 96
    assert len(forwards) < 48


def test_a_draft_of_another_vocabulary_is_refused_before_loading(tiny_llama_dir: Path) -> None:
    spec = {"model": "llama-tiny", "num_speculative_tokens": 2}  # 512 tokens, the target 384
    with pytest.raises(ValueError, match=r"speculative_config.model 'llama-tiny': a vocabulary"):
        LLM(str(tiny_llama_dir), device="cpu", speculative_config=spec)
