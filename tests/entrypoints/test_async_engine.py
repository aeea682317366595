"""AsyncLLMEngine: streaming outputs, aborts that free blocks at once, bad requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from attnserve.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import HANG_GUARD_S, hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> AsyncLLMEngine:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))
    yield engine  # type: ignore[misc]
    engine.shutdown()


def _all_free(engine: AsyncLLMEngine) -> bool:
    allocator = engine.engine.allocator
    return allocator.num_free_blocks == allocator.num_blocks


def test_delta_stream_concatenates_to_the_greedy_answer(
    engine: AsyncLLMEngine, tiny_llama_dir: Path
) -> None:
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def collect() -> list[list[int]]:
        return [out.outputs[0].token_ids async for out in engine.generate(prompt, params, "s")]

    deltas = asyncio.run(collect())
    assert len(deltas) == 10 and all(len(d) == 1 for d in deltas)
    assert [t for d in deltas for t in d] == hf_greedy(tiny_llama_dir, prompt, 10)
    assert _all_free(engine)


def test_concurrent_requests_and_early_exit_abort(engine: AsyncLLMEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def first_two(request_id: str) -> int:
        seen = 0
        async for _ in engine.generate([5, 6, 7], long, request_id):
            seen += 1
            if seen == 2:
                break  # the consumer leaves: its request must be aborted
        return seen

    async def run() -> list[object]:
        gens = [first_two(f"quit-{i}") for i in range(4)]
        finished = [_final(engine.generate([8, 9], short, f"done-{i}")) for i in range(4)]
        return await asyncio.gather(*gens, *finished)

    results = asyncio.run(run())
    assert results[:4] == [2, 2, 2, 2]
    assert all(len(r.outputs[0].token_ids) == 5 for r in results[4:])  # type: ignore[attr-defined]
    assert not engine.engine.has_unfinished_requests()
    assert _all_free(engine)


async def _final(stream: object) -> object:
    last = None
    async for out in stream:  # type: ignore[attr-defined]
        last = out
    return last


def test_explicit_abort_frees_blocks(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate(list(range(2, 60)), params, "victim")
        await stream.__anext__()
        assert not _all_free(engine)
        engine.abort("victim")
        assert _all_free(engine)
        await stream.aclose()

    asyncio.run(run())


def test_bad_request_raises_and_engine_keeps_serving(engine: AsyncLLMEngine) -> None:
    async def run() -> int:
        with pytest.raises(ValueError, match="token ids must be in"):
            async for _ in engine.generate([1, 99999], SamplingParams(), "bad"):
                pass
        out = await _final(engine.generate([1, 2], SamplingParams(max_tokens=3), "good"))
        return len(out.outputs[0].token_ids)  # type: ignore[attr-defined]

    assert asyncio.run(run()) <= 3
    assert _all_free(engine)


def test_a_failing_engine_fails_requests_instead_of_hanging(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))

    def broken_step() -> list[object]:
        raise RuntimeError("device lost")

    engine.engine.step = broken_step  # type: ignore[method-assign,assignment]

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=3), "a"):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=3), "b"):
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=HANG_GUARD_S))
    finally:
        engine.shutdown()
