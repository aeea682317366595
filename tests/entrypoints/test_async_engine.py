"""AsyncLLMEngine over an engine core process (its default) and over an in-process core:
streamed outputs against HF's greedy answer, aborts that free every block, bad requests, the
same tokens in both modes, merged deltas, and a failing or killed core that fails requests
instead of hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from attnserve.engine.llm_engine import LLMEngine
from attnserve.engine.proc_client import ProcClient
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import HANG_GUARD_S, hf_greedy


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))
    yield engine
    engine.shutdown()


def _all_free(engine: AsyncLLMEngine) -> bool:
    """Every KV block free (stats are answered after every command sent before them)."""
    return engine.stats()["kv_cache_usage"] == 0


def _run(coroutine: object) -> object:
    return asyncio.run(asyncio.wait_for(coroutine, HANG_GUARD_S))  # type: ignore[arg-type]


async def _final(stream: object) -> RequestOutput:
    last = None
    async for out in stream:  # type: ignore[attr-defined]
        last = out
    assert last is not None
    return last


def test_the_core_runs_in_its_own_process(engine: AsyncLLMEngine) -> None:
    client = engine.engine.client
    assert isinstance(client, ProcClient) and client.ready.pid != os.getpid()
    with pytest.raises(RuntimeError, match="its own process"):
        engine.engine.engine_core  # noqa: B018


def test_delta_stream_concatenates_to_the_greedy_answer(
    engine: AsyncLLMEngine, tiny_llama_dir: Path
) -> None:
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def collect() -> list[list[int]]:
        return [out.outputs[0].token_ids async for out in engine.generate(prompt, params, "s")]

    deltas: list[list[int]] = _run(collect())  # type: ignore[assignment]
    assert all(deltas) and len(deltas) <= 10  # a consumer behind gets several tokens at once
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

    results: list[object] = _run(run())  # type: ignore[assignment]
    assert results[:4] == [2, 2, 2, 2]
    assert all(len(r.outputs[0].token_ids) == 5 for r in results[4:])  # type: ignore[attr-defined]
    assert not engine.engine.has_unfinished_requests()
    assert _all_free(engine)


def test_explicit_abort_frees_blocks(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate(list(range(2, 60)), params, "victim")
        await stream.__anext__()
        assert not _all_free(engine)
        engine.abort("victim")
        assert _all_free(engine)
        await stream.aclose()

    _run(run())


def test_a_request_id_can_be_used_again_at_once(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> RequestOutput:
        stream = engine.generate([4, 5, 6], params, "again")
        await stream.__anext__()
        await stream.aclose()  # aborted; the core may still be reporting on it
        return await _final(engine.generate([4, 5, 6], short, "again"))

    out: RequestOutput = _run(run())  # type: ignore[assignment]
    assert len(out.outputs[0].token_ids) == 4 and out.finished
    assert _all_free(engine)


def test_bad_request_raises_and_engine_keeps_serving(engine: AsyncLLMEngine) -> None:
    async def run() -> int:
        with pytest.raises(ValueError, match="token ids must be in"):
            async for _ in engine.generate([1, 99999], SamplingParams(), "bad"):
                pass
        out = await _final(engine.generate([1, 2], SamplingParams(max_tokens=3), "good"))
        return len(out.outputs[0].token_ids)

    assert _run(run()) <= 3  # type: ignore[operator]
    assert _all_free(engine)


def _tokens(engine: AsyncLLMEngine, prompts: list[list[int]]) -> list[object]:
    """Greedy, seeded-sampled (n=2) and logprob tokens of `prompts`, through `engine`."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    jobs = [(f"{kind}-{i}", p, params) for i, p in enumerate(prompts) for kind, params in
            (("g", greedy), ("s", sampled))]  # fmt: skip

    async def run() -> list[RequestOutput]:
        return await asyncio.gather(*(_final(engine.generate(p, s, i)) for i, p, s in jobs))

    outputs: list[RequestOutput] = _run(run())  # type: ignore[assignment]
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_in_process_and_process_cores_give_the_same_tokens(
    engine: AsyncLLMEngine, tiny_llama_dir: Path
) -> None:
    prompts = [[3, 14, 15, 92, 65], list(range(10, 50)), [7] * 20]
    args = EngineArgs(str(tiny_llama_dir), device="cpu", engine_core_process=False)
    local = AsyncLLMEngine.from_engine_args(args)
    try:
        assert local.engine.engine_core is not None  # the core object lives here
        assert _tokens(local, prompts) == _tokens(engine, prompts)
    finally:
        local.shutdown()


def test_merged_deltas_equal_the_whole_output(tiny_llama_dir: Path) -> None:
    """What a consumer that fell behind gets: successive DELTA outputs merged into one."""
    llm = LLMEngine(EngineArgs(str(tiny_llama_dir), device="cpu"))
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True)
    llm.add_request("whole", [5, 6, 7], params)
    delta = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    llm.add_request("delta", [5, 6, 7], delta)
    outputs: dict[str, list[RequestOutput]] = {"whole": [], "delta": []}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outputs[out.request_id].append(out)
    deltas = outputs["delta"]
    merged = RequestOutput.merged(deltas)
    whole = outputs["whole"][-1]
    assert merged.finished and len(deltas) >= 9  # a fork may run a step behind
    assert [c.token_ids for c in merged.outputs] == [c.token_ids for c in whole.outputs]
    assert [c.finish_reason for c in merged.outputs] == ["length", "length"]
    assert deltas[0].outputs[0].token_ids == whole.outputs[0].token_ids[:1]  # left unchanged
    llm.shutdown()


@pytest.mark.parametrize("broken", ["core step", "output step"])
def test_a_failing_step_fails_requests_instead_of_hanging(
    tiny_llama_dir: Path, broken: str
) -> None:
    """A core step that raises, or an error turning a step into outputs (on the event loop),
    fails every waiting and later request, and the engine is dead after it."""
    args = EngineArgs(str(tiny_llama_dir), device="cpu", engine_core_process=False)
    engine = AsyncLLMEngine.from_engine_args(args)

    def fail(*_: object) -> object:
        raise RuntimeError(f"{broken} lost")

    if broken == "core step":
        engine.engine.engine_core.step = fail  # type: ignore[method-assign,assignment]
    else:
        engine.engine.process = fail  # type: ignore[method-assign,assignment]

    async def run() -> None:
        with pytest.raises(EngineDeadError, match=f"{broken} lost"):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=3), "a"):
                pass
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=3), "b"):
                pass

    try:
        _run(run())
        assert engine.errored
    finally:
        engine.shutdown()


def test_a_killed_core_process_fails_requests_and_leaves_no_process(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(str(tiny_llama_dir), device="cpu"))
    client = engine.engine.client
    assert isinstance(client, ProcClient)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def run() -> None:
        stream = engine.generate([1, 2, 3], params, "doomed")
        await stream.__anext__()
        assert engine.stats()["num_running"] == 1
        os.kill(client.ready.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await _final(engine.generate([1, 2], params, "after"))

    try:
        _run(run())
        assert engine.errored
        assert engine.stats()["num_running"] == 1  # the last gauges, not an error
    finally:
        engine.shutdown()
    assert not client.process.is_alive()
