"""Sampler against the distributions it should draw from."""

from __future__ import annotations

import pytest
import torch

from attnserve.sampling_params import SamplingParams
from attnserve.worker.sampler import Sampler
from attnserve.worker.sampling_metadata import SamplingMetadata
from tests.worker.rows import Row

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])


def _draw(params: SamplingParams, n: int = 4000) -> torch.Tensor:
    torch.manual_seed(0)
    logits = PROBS.log().repeat(n, 1)
    return Sampler().sample(logits, _metadata([params] * n))


def _metadata(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.from_rows([Row(p) for p in params], "cpu")


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(PROBS)).float() / len(tokens)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50)
    tokens = Sampler().sample(logits, _metadata([SamplingParams(temperature=0)] * 6))
    assert torch.equal(tokens, logits.argmax(-1))


def test_temperature_one_follows_the_distribution() -> None:
    freq = _frequencies(_draw(SamplingParams(temperature=1.0)))
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_top_k_keeps_the_k_most_likely_renormalised() -> None:
    freq = _frequencies(_draw(SamplingParams(top_k=2)))
    torch.testing.assert_close(freq, torch.tensor([2 / 3, 1 / 3, 0, 0, 0]), atol=0.03, rtol=0)


def test_top_p_keeps_the_nucleus() -> None:
    freq = _frequencies(_draw(SamplingParams(top_p=0.8)))  # 0.5 + 0.25 < 0.8: three survive
    assert freq[3] == 0 and freq[4] == 0 and freq[2] > 0


def test_min_p_drops_unlikely_tokens() -> None:
    freq = _frequencies(_draw(SamplingParams(min_p=0.2)))  # floor 0.1: 0.07 and 0.03 dropped
    assert freq[3] == 0 and freq[4] == 0 and freq[2] > 0


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=1.0, seed=1)] * 3
    alone = Sampler().sample(logits[1:2], _metadata(params[:1]), [42])
    batched = Sampler().sample(logits, _metadata(params), [7, 42, None])
    assert batched[1] == alone[0]
    again = Sampler().sample(logits, _metadata(params), [7, 42, None])
    assert again[0] == batched[0]


def _input(params: SamplingParams, **kwargs: object) -> Row:
    return Row(params, **kwargs)  # type: ignore[arg-type]


def test_banned_tokens_are_never_drawn() -> None:
    logits = PROBS.log()[None]
    params = SamplingParams(temperature=0, min_tokens=1)  # bans come before min_tokens
    (out,) = Sampler()(logits, [_input(params, banned_token_ids=(0, 1))])
    assert out.token_ids == [2]


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    row = _input(params, prompt_token_ids=[2], output_token_ids=[0, 0, 3])
    penalised = Sampler._apply_penalties(logits, [row])
    # token 0: seen twice in the output -> 2/2 - 0.5 - 0.5; token 2: in the prompt -> -1*2
    expected = torch.tensor([[2 / 2 - 0.5 - 0.25 * 2, 1.0, -2.0, 0.5 / 2 - 0.5 - 0.25]])
    torch.testing.assert_close(penalised, expected)


def test_parallel_draws_and_logprobs() -> None:
    logits = torch.randn(2, 30)
    rows = [
        _input(SamplingParams(n=3, temperature=1.0, logprobs=2), num_samples=3, sample_seed=5),
        _input(SamplingParams(temperature=0, logprobs=0)),
    ]
    first, second = Sampler()(logits, rows)
    assert len(first.token_ids) == 3 and len(second.token_ids) == 1
    assert first.logprobs is not None and second.logprobs is not None
    reference = torch.log_softmax(logits, -1)
    for token, entry in zip(first.token_ids, first.logprobs, strict=True):
        assert entry[token] == pytest.approx(float(reference[0, token]), abs=1e-5)
        top2 = reference[0].topk(2).indices.tolist()
        assert set(top2) <= set(entry)
    assert list(second.logprobs[0]) == [int(logits[1].argmax())]


def test_penalties_of_a_batch_match_hf_and_spare_other_rows() -> None:
    """Rows with and without penalties in one batch: each penalised row as HF transformers'
    RepetitionPenaltyLogitsProcessor (over prompt + output) computes it, the others untouched."""
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    histories = [([3, 7, 7], [1, 30]), ([5], [6]), ([9, 2], [])]
    rows = [
        _input(SamplingParams(repetition_penalty=1.7), prompt_token_ids=p, output_token_ids=o)
        for p, o in histories
    ]
    rows[1] = _input(SamplingParams())
    rows[2] = _input(
        SamplingParams(repetition_penalty=0.6), prompt_token_ids=[9, 2], output_token_ids=[]
    )
    penalised = Sampler._apply_penalties(logits, rows)
    for row, penalty in [(0, 1.7), (2, 0.6)]:
        prompt, output = histories[row]
        hf = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + output]), logits[row : row + 1].clone()
        )
        torch.testing.assert_close(penalised[row : row + 1], hf)
    assert torch.equal(penalised[1], logits[1])


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = torch.randn(3, 50)
    forced, forbidden = int(logits[0].argmin()), int(logits[1].argmax())
    rows = [
        _input(SamplingParams(temperature=0, logit_bias={forced: 100})),
        _input(SamplingParams(temperature=0, logit_bias={forbidden: -100, 4: 0.5})),
        _input(SamplingParams(temperature=0)),
    ]
    biased = Sampler._apply_bias(logits, rows)
    expected = logits.clone()
    expected[0, forced] += 100
    expected[1, forbidden] -= 100
    expected[1, 4] += 0.5
    torch.testing.assert_close(biased, expected)
    outputs = Sampler()(logits, rows)
    assert outputs[0].token_ids == [forced]
    assert outputs[1].token_ids != [forbidden]
    assert outputs[2].token_ids == [int(logits[2].argmax())]


def test_sampled_rows_never_draw_a_forbidden_token() -> None:
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, logit_bias={0: -100})
    draws = Sampler()(PROBS.log().repeat(500, 1), [_input(params)] * 500)
    assert all(d.token_ids != [0] for d in draws)  # token 0 has half the mass unbiased
