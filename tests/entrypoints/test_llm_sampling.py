"""The sampling fields through the offline `LLM` API, against independent references:
`repetition_penalty` against HF transformers' `generate` on the same weights, `logit_bias`
forcing and forbidding tokens, `best_of` against the n candidates it chose from (same seed),
seeded sampling, stop tokens' text and `include_stop_str_in_output` against the tokenizer, and
prompt log-probabilities under prefix caching. Every request's blocks are free afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.entrypoints.openai_server import tiny_model_with_tokenizer

PROMPT = [5, 9, 14, 3, 22, 7]
NEW_TOKENS = 16
# Half the vocabulary seen: a repetition penalty moves many candidates (a random model repeats
# little of its own).
SEEN_HALF = list(range(2, 384, 2))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> Iterator[LLM]:
    engine = LLM(str(tiny_llama_dir), device="cpu", block_size=4)
    yield engine
    assert engine.llm_engine.stats()["kv_cache_usage"] == 0  # no block leaked
    engine.shutdown()


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    model = tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny_text_model"))
    engine = LLM(str(model), device="cpu")
    yield engine
    assert engine.llm_engine.stats()["kv_cache_usage"] == 0
    engine.shutdown()


def _one(llm: LLM, params: SamplingParams, prompt: Any = PROMPT) -> Any:
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return output


def _greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)


def _hf_penalised(model_dir: Path, prompt: list[int], penalty: float) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            repetition_penalty=penalty,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_repetition_penalty_matches_hf_generate(llm: LLM, tiny_llama_dir: Path) -> None:
    plain = _one(llm, _greedy(), SEEN_HALF).outputs[0].token_ids
    assert plain == hf_greedy(tiny_llama_dir, SEEN_HALF, NEW_TOKENS)
    for penalty in (1.5, 0.7):
        penalised = _one(llm, _greedy(repetition_penalty=penalty), SEEN_HALF).outputs[0]
        assert penalised.token_ids == _hf_penalised(tiny_llama_dir, SEEN_HALF, penalty)
        assert penalised.token_ids != plain


def test_logit_bias_forces_and_forbids_a_token(llm: LLM) -> None:
    plain = _one(llm, _greedy()).outputs[0].token_ids
    forced = _one(llm, _greedy(logit_bias={42: 100})).outputs[0].token_ids
    assert forced == [42] * NEW_TOKENS
    banned = plain[0]
    forbidden = _one(llm, _greedy(logit_bias={banned: -100})).outputs[0].token_ids
    assert banned not in forbidden and forbidden[0] != plain[0]


def test_logit_bias_outside_the_vocabulary_is_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in 0\.\.383"):
        _one(llm, _greedy(logit_bias={384: 1.0}))


def _sampled(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, **kwargs)


def test_best_of_returns_the_best_candidates_by_cumulative_logprob(llm: LLM) -> None:
    """best_of=4 draws the same four candidates as n=4 with the same seed, and keeps the best."""
    candidates = _one(llm, _sampled(n=4)).outputs
    by_score = sorted(candidates, key=lambda c: -c.cumulative_logprob)
    assert len({c.cumulative_logprob for c in candidates}) == 4
    (best,) = _one(llm, _sampled(n=1, best_of=4)).outputs
    assert best.token_ids == by_score[0].token_ids
    assert best.cumulative_logprob == pytest.approx(by_score[0].cumulative_logprob)
    two = _one(llm, _sampled(n=2, best_of=4)).outputs
    kept = by_score[:2]  # the best two, best first (as vLLM orders them)
    assert [c.token_ids for c in two] == [c.token_ids for c in kept]
    assert [c.index for c in two] == [0, 1]


def test_seed_makes_sampling_reproducible_whatever_the_batch(llm: LLM) -> None:
    alone = _one(llm, _sampled()).outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)] * 2
    batch = llm.generate([[1, 2, 3], PROMPT, [4, 5]], [others[0], _sampled(), others[1]])
    assert batch[1].outputs[0].token_ids == alone
    reseeded = _one(llm, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True))
    assert reseeded.outputs[0].token_ids != alone


def test_prompt_logprobs_are_whole_when_the_prompt_is_cached(llm: LLM) -> None:
    prompt = list(range(30, 50))  # five blocks of 4: cached after the first request
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first, second = (_one(llm, params, prompt) for _ in range(2))
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(prompt)
    assert second.prompt_logprobs == first.prompt_logprobs


def test_stop_token_text_is_left_out_unless_asked_for(text_llm: LLM) -> None:
    tokenizer = text_llm.get_tokenizer()
    prompt = "The list goes on:"
    free = _one(text_llm, _greedy(), prompt).outputs[0]
    stop_at = free.token_ids[2]
    end = free.token_ids.index(stop_at) + 1
    assert tokenizer.decode([stop_at])  # the stop token has text of its own
    stopped = _one(text_llm, _greedy(stop_token_ids=[stop_at]), prompt).outputs[0]
    assert stopped.token_ids == free.token_ids[:end] and stopped.finish_reason == "stop"
    assert stopped.text == tokenizer.decode(free.token_ids[: end - 1])
    params = _greedy(stop_token_ids=[stop_at], include_stop_str_in_output=True)
    kept = _one(text_llm, params, prompt).outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[:end]) != stopped.text


def test_include_stop_str_in_output_keeps_the_stop_string(text_llm: LLM) -> None:
    prompt = "Once upon a time"
    text = _one(text_llm, _greedy(), prompt).outputs[0].text
    stop = text[8:11]
    cut = text.index(stop)
    params = _greedy(stop=stop)
    assert _one(text_llm, params, prompt).outputs[0].text == text[:cut]
    params = _greedy(stop=stop, include_stop_str_in_output=True)
    assert _one(text_llm, params, prompt).outputs[0].text == text[: cut + len(stop)]


def test_two_threads_draw_what_one_does_and_keep_the_thread_count(llm: LLM) -> None:
    """On the CPU the sampler runs on one torch thread inside each step
    (`worker/step_sampling.sampling_threads`); the caller's thread count is back afterwards and the
    seeded and greedy draws equal a one-thread run's."""
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=NEW_TOKENS, ignore_eos=True),
    ]
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
            assert torch.get_num_threads() == threads
            runs.append([o.outputs[0].token_ids for o in outputs])
    finally:
        torch.set_num_threads(before)
    assert runs[0] == runs[1]
