"""Greedy parity on the embedded default model: attnserve's tokens and log-probabilities equal
HF transformers' on the same (GGUF-dequantized, fp32) weights, whatever the block size and batch.
The engine runs dequantized too (quantization "none"): the packed default runs its decode
matmuls on int8-rounded activations (tests/model/test_gguf_quality.py compares the two)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.model.models.hf_export import to_hf_model

NEW_TOKENS = 16  # every prompt's decode crosses a 16-token block boundary
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "Les trois couleurs du drapeau français sont",
]
CHATS = [
    "What is the capital of Japan?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]


@pytest.fixture(scope="module")
def reference(default_llm_dequantized: LLM) -> tuple[LLM, Any, list[list[int]]]:
    """The dequantized default engine, HF transformers' model on its weights, and the prompts
    (raw text, then chat-formatted) as token ids."""
    llm = default_llm_dequantized
    tokenizer = llm.get_tokenizer()
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
        )
        for c in CHATS
    ]
    prompts = [tokenizer.encode(p) for p in RAW_PROMPTS + chats]
    return (
        llm,
        to_hf_model(llm.llm_engine.executor.driver_runner.model, llm.llm_engine.model_config),
        prompts,
    )


@pytest.fixture(scope="module")
def hf_tokens(reference: tuple[LLM, Any, list[list[int]]]) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, one prompt at a time."""
    _, hf, prompts = reference
    hf.generation_config.eos_token_id = None
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # an explicit mask: HF would otherwise mask every <|im_end|> (its pad id) as padding
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            tokens.append(out[0, len(prompt) :].tolist())
    return tokens


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(("block_size", "max_num_seqs"), [(1, 8), (16, 3), (128, 256)])
def test_greedy_tokens_equal_hf(
    reference: tuple[LLM, Any, list[list[int]]],
    hf_tokens: list[list[int]],
    block_size: int,
    max_num_seqs: int,
) -> None:
    _, _, prompts = reference
    llm = LLM(
        device="cpu",
        max_model_len=512,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        quantization="none",
    )
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == hf_tokens


def test_logprobs_and_prompt_logits_match_hf(reference: tuple[LLM, Any, list[list[int]]]) -> None:
    llm, hf, prompts = reference
    prompt = prompts[5]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=3)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        hf_logprobs = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None
        for token, value in entry.items():
            want = float(hf_logprobs[position - 1, token])
            assert value.logprob == pytest.approx(want, abs=1e-4)
        assert set(hf_logprobs[position - 1].topk(3).indices.tolist()) <= set(entry)
    assert out.outputs[0].logprobs is not None
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = hf_logprobs[len(prompt) - 1 + step]
        for token, value in entry.items():
            assert value.logprob == pytest.approx(float(row[token]), abs=1e-4)
