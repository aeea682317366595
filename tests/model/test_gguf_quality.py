"""The embedded default model kept packed (the CPU default) against its dequantized run: equal
greedy tokens on chat prompts. (`attnserve bench quality` measured 8 prompts x 128 tokens equal;
docs/benchmarks.md.) Packed decode steps round activations to int16 per 32-block, which moves
logits by ~1e-5: a parting would need a near-tie, and the assertion shows where."""

from __future__ import annotations

from attnserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning a new language.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _greedy(llm: LLM) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [list(o.outputs[0].token_ids) for o in llm.chat(chats, GREEDY, use_tqdm=False)]


def test_packed_default_model_greedy_equals_its_dequantized_run(
    default_llm: LLM, default_llm_dequantized: LLM
) -> None:
    assert default_llm.llm_engine.model_config.quantization == "gguf"
    assert default_llm_dequantized.llm_engine.model_config.quantization is None
    packed, dequantized = _greedy(default_llm), _greedy(default_llm_dequantized)
    partings = [
        next((i for i, (a, b) in enumerate(zip(p, d, strict=True)) if a != b), None)
        for p, d in zip(packed, dequantized, strict=True)
    ]
    assert partings == [None] * len(QUESTIONS), f"first differing token per prompt: {partings}"
