"""Speculative decoding draws from the target distribution: thousands of unseeded samples of a
tiny random Llama over 16 tokens, with n-gram drafts verified on many of them, against the exact
joint probabilities HF transformers computes on the same weights (a chi-square test of the first
two and the first three output tokens), and the same check failing on two broken verifiers; and
a seeded request draws the very tokens it draws without speculation, every sampling feature on.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.spec_decode import verifier
from attnserve.step_types import SampleOutput
from tests.conftest import TINY_LLAMA, _save_random_llama

VOCAB = 16
VOCAB16_LLAMA = {**TINY_LLAMA, "vocab_size": VOCAB, "eos_token_id": VOCAB - 1, "bos_token_id": 0}
LM_HEAD_SCALE = 2.0  # sharper next-token distributions: fewer joint cells, more accepted drafts
# Mostly a sample of the model itself (so its drafts are often right), over 9 of the 16 tokens
# (so about half the first tokens find a draft), 22 tokens: with blocks of 4, a verify query of
# the 23rd to the 25th position crosses a block boundary.
PROMPT = [3, 7, 10, 5, 12, 10, 5, 15, 5, 15, 5, 15, 5, 15, 15, 15, 13, 10, 12, 8, 7, 0]
MAX_TOKENS = 4  # after the first token, room for 2 drafts and the token drawn after them
NUM_SAMPLES = 4000
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
    "disable_by_batch_size": 1024,  # every step speculates
}
# Each check's significance: a correct sampler fails one of this file's chi-square checks with
# probability below 1e-6 (5 checks of a correct distribution, ALPHA each), whatever the seed.
ALPHA = 1e-7
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one


@pytest.fixture(scope="module")
def vocab16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random HF Llama over 16 tokens, its LM head scaled by LM_HEAD_SCALE."""
    from safetensors.torch import load_file, save_file

    path = _save_random_llama(tmp_path_factory, "vocab16_llama", VOCAB16_LLAMA)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    weights["lm_head.weight"] = weights["lm_head.weight"] * LM_HEAD_SCALE
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target_joint(vocab16_dir: Path) -> torch.Tensor:
    """The exact probability of every first three output tokens after PROMPT, [V, V, V] float64:
    p(t1 | prompt) p(t2 | prompt, t1) p(t3 | prompt, t1, t2), from HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vocab16_dir, dtype=torch.float32).eval()
    joint = torch.ones(1, dtype=torch.float64)
    for depth in range(3):
        prefixes = [PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=depth)]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()
        joint = (joint[:, None] * logits.softmax(-1)).reshape(-1)
    return joint.reshape(VOCAB, VOCAB, VOCAB)


def _sample(model_dir: Path, **engine_kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """NUM_SAMPLES unseeded completions of PROMPT at temperature 1 with n-gram speculation: the
    counts of their first three tokens [V, V, V] and the engine's stats."""
    llm = LLM(
        str(model_dir), device="cpu", block_size=4, speculative_config=SPEC, seed=7, **engine_kwargs
    )
    try:
        params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for output in outputs:
        tokens = output.outputs[0].token_ids
        assert len(tokens) == MAX_TOKENS
        counts[tuple(tokens[:3])] += 1
    return counts, stats


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square test of `counts` against `probs` (same shape): the p-value and the
    number of cells tested, those expected fewer than MIN_EXPECTED times pooled into one."""
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    expected = probs / probs.sum() * counts.sum()
    large = expected >= MIN_EXPECTED
    observed = torch.cat([counts[large], counts[~large].sum(0, keepdim=True)])
    expected = torch.cat([expected[large], expected[~large].sum(0, keepdim=True)])
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = len(observed) - 1
    # The chi-square survival function: the regularized upper incomplete gamma Q(df/2, x/2).
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2)
    return float(p_value), len(observed)


def _p_values(counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """The p-values of the first two output tokens' joint and of the first three's."""
    p2, cells2 = chi_square_p_value(counts.sum(2), joint.sum(2))
    p3, cells3 = chi_square_p_value(counts, joint)
    assert cells2 >= 15 and cells3 >= 40  # not a degenerate test
    return p2, p3


@pytest.mark.parametrize("enable_prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
def test_speculative_samples_follow_the_target_distribution(
    vocab16_dir: Path, target_joint: torch.Tensor, enable_prefix_caching: bool
) -> None:
    counts, stats = _sample(vocab16_dir, enable_prefix_caching=enable_prefix_caching)
    # The test proves something only where drafts were verified and many accepted: the second
    # token is then decided by verification, the third often drawn after an accepted draft.
    assert stats["spec_decode_num_drafts"] >= NUM_SAMPLES // 2
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_drafts"]  # some of 2
    assert stats["spec_decode_num_accepted_tokens"] >= NUM_SAMPLES // 10
    p2, p3 = _p_values(counts, target_joint)
    assert p2 > ALPHA, f"first two tokens: p = {p2:.3g}"
    assert p3 > ALPHA, f"first three tokens: p = {p3:.3g}"


def test_the_check_fails_when_every_draft_is_accepted(
    vocab16_dir: Path, target_joint: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier that keeps every draft (and the token drawn after the last): the second token
    is then the draft whenever there is one, and the chi-square check must see it."""

    def keep_every_draft(drawn: list[SampleOutput], drafts: list[int]) -> SampleOutput:
        if not drafts:
            return drawn[0]
        return SampleOutput([*drafts, drawn[len(drafts)].token_ids[0]])

    monkeypatch.setattr(verifier, "_kept", keep_every_draft)
    counts, stats = _sample(vocab16_dir)
    assert stats["spec_decode_acceptance_rate"] == 1.0
    p2, _ = _p_values(counts, target_joint)
    assert p2 < ALPHA, f"a verifier that accepts every draft passed: p = {p2:.3g}"


def test_the_check_fails_when_the_token_after_accepted_drafts_has_the_wrong_context(
    vocab16_dir: Path, target_joint: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier whose token after accepted drafts is the first position's draw (drawn as if
    the drafts were not there): right second tokens, wrong third ones where a draft was kept."""
    kept = verifier._kept

    def wrong_context(drawn: list[SampleOutput], drafts: list[int]) -> SampleOutput:
        result = kept(drawn, drafts)
        if len(result.token_ids) < 2:
            return result
        return SampleOutput([*result.token_ids[:-1], drawn[0].token_ids[0]])

    monkeypatch.setattr(verifier, "_kept", wrong_context)
    counts, _ = _sample(vocab16_dir)
    p2, p3 = _p_values(counts, target_joint)
    assert p2 > ALPHA  # the second token is still right
    assert p3 < ALPHA, f"a third token drawn without the accepted draft passed: p = {p3:.3g}"


def test_a_verifier_that_claims_drafts_it_did_not_draw_is_caught(
    vocab16_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting every draft through `num_accepted` alone keeps the draws, not the drafts: the
    scheduler refuses tokens it did not draft instead of emitting them."""
    monkeypatch.setattr(verifier, "num_accepted", lambda drawn, drafts: len(drafts))
    llm = LLM(str(vocab16_dir), device="cpu", speculative_config=SPEC, seed=7)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        with pytest.raises(RuntimeError, match="accepted tokens it did not draft"):
            llm.generate([PROMPT] * 64, params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_seeded_draws_survive_preemption(vocab16_dir: Path, preemption_mode: str) -> None:
    """A KV cache of 40 blocks of 4 for 12 sequences of up to 62 tokens: sequences are
    preempted (their drafts dropped) and come back; each draws what it draws without
    speculation."""
    kwargs: dict[str, Any] = {
        "device": "cpu",
        "block_size": 4,
        "kv_cache_memory_bytes": 40 * 2048,  # a block: 2 layers x K, V x 4 tokens x 2 x 16 fp32
        "preemption_mode": preemption_mode,
        "enable_prefix_caching": True,
    }
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, ignore_eos=True) for i in range(12)
    ]
    outputs = []
    for spec in (None, SPEC):
        llm = LLM(str(vocab16_dir), speculative_config=spec, **kwargs)
        try:
            outputs.append(llm.generate([PROMPT] * len(params), params, use_tqdm=False))
            stats = llm.llm_engine.stats()
        finally:
            llm.shutdown()
        assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    plain, speculative = outputs
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]


# The seeded tests: the embedded default model, its weights dequantized (fp32: a verify step's
# logits are then a decode step's to ~1e-5; the packed GGUF kernels of a decode and of a query of
# several tokens differ by ~1e-3), on repetitive prompts, so drafts get accepted.
CAT = "The cat sat on the mat. The dog sat on the log. " * 4 + "The cat sat"
LAUGH = "He laughed: ha ha ha ha ha ha ha ha ha ha ha ha"
COUNT = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"
SEEDED_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "prompt_lookup_max": 3}  # fmt: skip


@pytest.fixture(scope="module")
def default_spec_llm() -> Iterator[LLM]:
    """`default_llm_dequantized`'s engine with n-gram speculation."""
    llm = LLM(device="cpu", max_model_len=512, quantization="none", speculative_config=SEEDED_SPEC)
    yield llm
    llm.shutdown()


def test_seeded_requests_draw_the_same_tokens_with_speculation(
    default_llm_dequantized: LLM, default_spec_llm: LLM
) -> None:
    """Token for token, and the same log-probabilities: each draft position has its output
    position's seed, sees the drafts before it for penalties and min_tokens, and a kept draft's
    log-probabilities are its own position's."""
    tokenizer = default_llm_dequantized.get_tokenizer()
    (mat,) = tokenizer.encode(" mat")
    three = tokenizer.encode(" 3")[-1]
    every: dict[str, Any] = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.2,
        "min_tokens": 5,
        "logit_bias": {mat: 2.0},
        "max_tokens": 32,
        "logprobs": 2,  # log-probabilities follow the penalties and bans of each position
    }
    light = {**every, "repetition_penalty": 1.0, "temperature": 0.5}  # repeats, so drafts recur
    plain = {**light, "frequency_penalty": 0.0, "presence_penalty": 0.0, "temperature": 0.3}
    requests = [
        (CAT, SamplingParams(seed=1, **every)),
        (CAT, SamplingParams(seed=3, n=2, **every)),  # forks: a seed per completion
        (CAT, SamplingParams(seed=4, stop=[" log"], **every)),  # a stop string
        (LAUGH, SamplingParams(seed=11, **{**light, "frequency_penalty": 0.1})),
        (COUNT, SamplingParams(seed=12, **{**light, "frequency_penalty": 0.05})),
        # the stop token banned before min_tokens, also at the draft positions past the first
        (COUNT, SamplingParams(seed=18, stop_token_ids=[three], **{**plain, "min_tokens": 4})),
    ]
    prompts, params = [p for p, _ in requests], [p for _, p in requests]
    default_spec_llm.llm_engine.reset_stats()
    expected = default_llm_dequantized.generate(prompts, params, use_tqdm=False)
    got = default_spec_llm.generate(prompts, params, use_tqdm=False)
    stats = default_spec_llm.llm_engine.stats()
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] >= 10
    for want, have in zip(expected, got, strict=True):
        assert len(have.outputs) == len(want.outputs)
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert (b.text, b.finish_reason) == (a.text, a.finish_reason)
            assert a.logprobs is not None and b.logprobs is not None
            assert len(b.logprobs) == len(a.logprobs)
            for position, (entries_a, entries_b) in enumerate(
                zip(a.logprobs, b.logprobs, strict=True)
            ):
                assert entries_b.keys() == entries_a.keys(), position
                for token, logprob in entries_a.items():
                    want = logprob.logprob
                    assert entries_b[token].logprob == pytest.approx(want, abs=1e-4), position
