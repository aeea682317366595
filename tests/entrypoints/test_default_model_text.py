"""Text-level behaviour on the embedded default model (SmolLM2-135M-Instruct, real tokenizer):
chat, stop strings across token boundaries, streamed text equal to the final text."""

from __future__ import annotations

import asyncio

import pytest

from attnserve import LLM, SamplingParams
from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.sampling_params import RequestOutputKind

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(default_llm: LLM) -> LLM:
    """The shared default model (tests/conftest.py)."""
    return default_llm


def test_chat_answers_the_question(llm: LLM) -> None:
    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stop_string_across_tokens_is_cut_from_the_text(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24)
    text = llm.chat(QUESTION, free, use_tqdm=False)[0].outputs[0].text
    stop = text[text.index("Paris") - 3 : text.index("Paris") + 3]  # spans several tokens
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    out = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"


def test_incremental_detokenizer_never_splits_characters(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = "Grüße aus Köln 🌍🚀 — 東京タワー, naïve café! ∑ x² ≤ 3"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detok.step([ids[i]], final=i == len(ids) - 1) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_streamed_deltas_concatenate_to_the_final_text(llm: LLM) -> None:
    args = EngineArgs(device="cpu", max_model_len=1024, engine_core_process=False)
    engine = AsyncLLMEngine.from_engine_args(args)  # streaming is the front end's: one process
    question = [{"role": "user", "content": "Écris « bonjour » en japonais et en russe 🌍🙂"}]
    prompt = llm.get_tokenizer().apply_chat_template(
        question, tokenize=False, add_generation_prompt=True
    )
    stops = ["never-seen-stop"]  # text is held back while it could still begin a stop
    delta = SamplingParams(
        temperature=0, max_tokens=30, stop=stops, output_kind=RequestOutputKind.DELTA
    )
    final = SamplingParams(temperature=0, max_tokens=30, stop=stops)

    async def run() -> tuple[str, str]:
        streamed = "".join(
            [out.outputs[0].text async for out in engine.generate(prompt, delta, "d")]
        )
        last = None
        async for out in engine.generate(prompt, final, "f"):
            last = out
        assert last is not None
        return streamed, last.outputs[0].text

    try:
        streamed, whole = asyncio.run(run())
    finally:
        engine.shutdown()
    assert streamed == whole and not whole.isascii()  # multi-byte characters were streamed
