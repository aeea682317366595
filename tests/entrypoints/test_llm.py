"""The offline `LLM` API end to end, against HF transformers on the same weights.

Greedy tokens must equal HF's `generate` however the engine schedules: one batch, chunked
prefill under a small token budget, preemption by recompute and by swap under a tiny KV cache,
prefix-cache hits, parallel sampling.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from tests.conftest import hf_greedy

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 380) for _ in range(n)] for n in (5, 23, 41, 9)]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(tiny_llama_dir, p, NEW_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

ENGINE_SETUPS = {
    "one-batch": {},
    "chunk-1": {"max_num_batched_tokens": 1},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "chunk-512": {"max_num_batched_tokens": 512, "block_size": 1},
    "recompute-preemption": {"kv_cache_memory_bytes": 14 * 4096, "block_size": 4},
    "swap-preemption": {
        "kv_cache_memory_bytes": 14 * 4096,
        "block_size": 4,
        "preemption_mode": "swap",
    },
    "no-prefix-cache": {"enable_prefix_caching": False, "max_num_seqs": 2},
}


@pytest.mark.parametrize("setup", ENGINE_SETUPS, ids=str)
def test_greedy_matches_hf(
    tiny_llama_dir: Path, prompts: list[list[int]], expected: list[list[int]], setup: str
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", **ENGINE_SETUPS[setup])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.llm_engine.stats()
    if "preemption" in setup:
        assert stats["num_preemptions"] > 0
    assert llm.llm_engine.stats()["kv_cache_usage"] == 0


def test_prefix_cache_hits_keep_outputs(
    tiny_llama_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=4)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0.3


def test_parallel_sampling_and_seeds(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (together,) = llm.generate(prompts[1:2], params, use_tqdm=False)
    assert [c.index for c in together.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in together.outputs]
    assert len(set(samples)) > 1  # independent draws
    mixed = llm.generate(prompts, [GREEDY, params, GREEDY, GREEDY], use_tqdm=False)
    assert [tuple(c.token_ids) for c in mixed[1].outputs] == samples  # batch-independent
    assert llm.llm_engine.stats()["kv_cache_usage"] == 0


def test_greedy_n_copies_and_best_of(
    tiny_llama_dir: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate(prompts[:1], params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [expected[0], expected[0]]
    best = SamplingParams(n=1, best_of=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(prompts[:1], best, use_tqdm=False)
    assert len(out.outputs) == 1 and out.outputs[0].cumulative_logprob is not None


def test_logprobs_and_prompt_logprobs(tiny_llama_dir: Path, prompts: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate(prompts[1:2], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 3
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the likeliest
        assert sorted(lp.rank for lp in entry.values()) == [1, 2]  # vLLM's Logprob objects
        assert all(lp.decoded_token is None for lp in entry.values())  # no tokenizer
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompts[1])  # across chunks of 8
    for token, entry in zip(prompts[1][1:], out.prompt_logprobs[1:], strict=True):
        assert entry is not None and token in entry and all(v.logprob <= 0 for v in entry.values())


def test_cumulative_logprob_is_filled_whether_logprobs_are_asked_or_not(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    """As in vLLM: the sum of the drawn tokens' log-probabilities, here against HF's logits."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_llama_dir), device="cpu")
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    with_top = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts[:2], [GREEDY, sampled], use_tqdm=False)
    outputs += llm.generate(prompts[2:3], with_top, use_tqdm=False)  # alone: no top-k above
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=False):
        completion = output.outputs[0]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        drawn = [logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(completion.token_ids)]
        assert completion.cumulative_logprob == pytest.approx(float(sum(drawn)), abs=1e-4)
    top = outputs[2].outputs[0]
    assert top.logprobs is not None and outputs[0].outputs[0].logprobs is None
    chosen = sum(entry[t].logprob for t, entry in zip(top.token_ids, top.logprobs, strict=True))
    assert top.cumulative_logprob == pytest.approx(chosen, abs=1e-6)


def test_min_tokens_and_stop_token_ids(tiny_llama_dir: Path, expected: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    prompt = [5, 6, 7]
    free_run = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free_run[3]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[stop_at])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: free_run.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    banned = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, stop_token_ids=[stop_at]
    )
    out = llm.generate([prompt], banned, use_tqdm=False)[0].outputs[0]
    assert stop_at not in out.token_ids and len(out.token_ids) == NEW_TOKENS


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ([], {}, "non-empty list"),
        ([1, 2, 9999], {}, "token ids must be in"),
        ("text", {}, "no tokenizer"),
        (list(range(2, 600)), {}, "max_model_len"),
    ],
)
def test_bad_requests_are_value_errors_and_leak_nothing(
    tiny_llama_dir: Path, prompt: object, kwargs: dict[str, object], message: str
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    with pytest.raises(ValueError, match=message):
        llm.generate([[3, 4], prompt], GREEDY, use_tqdm=False)  # type: ignore[list-item]
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.stats()["kv_cache_usage"] == 0


def test_bad_engine_arguments_are_value_errors(tiny_llama_dir: Path) -> None:
    for kwargs, message in [
        ({"block_size": 0}, "block_size"),
        ({"preemption_mode": "pray"}, "preemption_mode"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_llama_dir), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_sampling_params_as_a_dict_as_vllm_takes_them(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    prompts = [[3, 4, 5], [7, 8]]
    fields = {"temperature": 0, "max_tokens": 3, "ignore_eos": True}
    as_dict = llm.generate(prompts, fields, use_tqdm=False)
    as_params = llm.generate(prompts, SamplingParams(**fields), use_tqdm=False)  # type: ignore[arg-type]
    assert [o.outputs[0].token_ids for o in as_dict] == [o.outputs[0].token_ids for o in as_params]
    assert all(len(o.outputs[0].token_ids) == 3 for o in as_dict)
    per_prompt = llm.generate(prompts, [fields, {**fields, "max_tokens": 1}], use_tqdm=False)  # type: ignore[list-item]
    assert [len(o.outputs[0].token_ids) for o in per_prompt] == [3, 1]


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (None, None, "prompts must be a string, a list of token ids, a prompt dict or a list"),
        (3, None, "got int"),
        ([[3, 4]], {"max_tokenz": 3}, "max_tokenz"),
        ([[3, 4]], "greedy", "sampling_params must be a SamplingParams, a dict"),
    ],
)
def test_wrong_argument_types_are_value_errors(
    tiny_llama_dir: Path, prompts: object, params: object, message: str
) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_without_messages_is_a_value_error(default_llm: LLM) -> None:
    for messages in ([], [[]], [[{"role": "user", "content": "Hi"}], []]):
        with pytest.raises(ValueError, match="at least one message"):
            default_llm.chat(messages, use_tqdm=False)  # type: ignore[arg-type]


def test_best_of_returns_the_best_n_best_first(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu")
    params = SamplingParams(n=3, best_of=6, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([[3, 4, 5]], params, use_tqdm=False)
    scores = [c.cumulative_logprob for c in out.outputs]
    assert len(scores) == 3 and all(s is not None for s in scores)
    assert scores == sorted(scores, reverse=True)  # type: ignore[type-var]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    everything = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    (all_six,) = llm.generate([[3, 4, 5]], everything, use_tqdm=False)
    top = sorted((c.cumulative_logprob for c in all_six.outputs), reverse=True)[:3]  # type: ignore[type-var]
    assert scores == pytest.approx(top)  # the same six draws, the best three of them
