"""Structured outputs keep async scheduling: a step with constrained draws launches its forward
pass while the step before is still in flight, and hands over its token bitmask (launching its
draws) only once that step is read back and the matchers have taken its tokens.

Against the synchronous engine (`async_scheduling=False`) on a tiny random Llama with the default
model's tokenizer: the same tokens and finish reasons, greedy and seeded, for JSON schemas,
regexes and choices beside unconstrained requests, requests finishing at different steps (the
grammar's end, `max_tokens`, forks of `n`), with preemption, and with a request aborted mid-way.
Each matcher takes exactly the tokens its sequence kept, each once (never a token of the wasted
step after a sequence's end). The overlap itself is observed on the pipeline, not timed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from attnserve import LLM, SamplingParams, StructuredOutputsParams
from attnserve.engine.core.constrained_decoding import StructuredOutputManager
from attnserve.engine.core.sequence import Sequence
from attnserve.step_types import AsyncStepOutput, LaunchedForward, StepPlan, TokenBitmask
from tests.entrypoints.openai_server import tiny_model_with_tokenizer

PERSON = StructuredOutputsParams(
    json={
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
    }
)
REGEX = StructuredOutputsParams(regex=r"[A-Z][a-z]{2,5}-\d{2}")
CHOICE = StructuredOutputsParams(choice=["yes", "no", "maybe later"])
PROMPTS = [
    "Describe a person:",
    "A code:",
    "Yes or no?",
    "Tell me a story about the sea",
    "Another person, as JSON:",
    "Pick one:",
]
SETUPS = {
    "one-batch": {"kv_cache_memory_bytes": 1 << 22},
    "preempting": {"kv_cache_memory_bytes": 24 * 1024, "block_size": 4},
}
Completions = dict[str, list[tuple[list[int], str | None]]]
_request_ids = count()


def mixed(seeded: bool) -> list[SamplingParams]:
    """Constrained and free requests ending at different steps; greedy, or seeded draws."""
    requests: list[dict[str, Any]] = [
        {"max_tokens": 40, "structured_outputs": PERSON},
        {"max_tokens": 16, "structured_outputs": REGEX},
        {"max_tokens": 8, "structured_outputs": CHOICE, "n": 2 if seeded else 1},
        {"max_tokens": 14, "ignore_eos": True},
        {"max_tokens": 5, "structured_outputs": PERSON},  # cut by max_tokens
        {"max_tokens": 8, "structured_outputs": CHOICE, "ignore_eos": True},
    ]
    draws = [{"temperature": 1.0, "seed": i} if seeded else {"temperature": 0} for i in range(6)]
    return [SamplingParams(**r, **d) for r, d in zip(requests, draws, strict=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny_structured_async"))


@pytest.fixture
def fed(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int], list[int]]:
    """Every token each matcher takes, by (core request id, sequence index)."""
    taken: dict[tuple[str, int], list[int]] = defaultdict(list)
    advance = StructuredOutputManager.advance

    def recorded(seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        before = {id(s): s.grammar.num_accepted for s in seqs if s.grammar is not None}
        ended = advance(seqs)
        for seq in seqs:
            if seq.grammar is not None:
                start = seq.num_prompt_tokens + before[id(seq)]
                end = seq.num_prompt_tokens + seq.grammar.num_accepted
                taken[seq.request_id, seq.index] += seq.token_ids[start:end]
        return ended

    monkeypatch.setattr(StructuredOutputManager, "advance", staticmethod(recorded))
    return taken


def drive(
    llm: LLM, params: list[SamplingParams], abort_at: dict[int, int] | None = None
) -> Completions:
    """Each request's completions (tokens, finish reason) as last reported, in request order;
    request i (of at most one per prompt) is aborted once it has reported `abort_at[i]` tokens."""
    engine = llm.llm_engine
    ids = [f"r{next(_request_ids)}" for _ in params]
    aborts = {ids[i]: n for i, n in (abort_at or {}).items()}
    for request_id, prompt, p in zip(ids, PROMPTS, params, strict=False):
        engine.add_request(request_id, prompt, p)
    seen: Completions = {request_id: [] for request_id in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = [(list(c.token_ids), c.finish_reason) for c in out.outputs]
            wanted = aborts.get(out.request_id)
            if wanted is not None and not out.finished and len(out.outputs[0].token_ids) >= wanted:
                engine.abort_request(out.request_id)
    assert engine.stats()["kv_cache_usage"] == 0
    return seen


def assert_matchers_took_the_kept_tokens(
    seen: Completions,
    fed: dict[tuple[str, int], list[int]],
    aborted: frozenset[str] = frozenset(),
) -> None:
    """Each matcher took its completion's tokens in order, once: all of them, or all but the
    last where the scheduler ended the sequence on it (EOS, `max_tokens`); an aborted one
    exactly those it reported. (The core's request id is the front end's, then "#n".)"""
    assert fed
    for (core_id, index), tokens in fed.items():
        request_id = core_id.rsplit("#", 1)[0]
        kept, _ = seen[request_id][index]
        if request_id in aborted:
            assert tokens == kept
        else:
            assert kept[: len(tokens)] == tokens and len(kept) - len(tokens) in (0, 1)


@pytest.fixture(scope="module", params=list(SETUPS))
def engines(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[dict[bool, LLM]]:
    """The synchronous and the async engine (by `async_scheduling`) under one setup."""
    setup = SETUPS[request.param]
    made = {
        overlap: LLM(
            str(model_dir), device="cpu", max_model_len=256, async_scheduling=overlap, **setup
        )
        for overlap in (False, True)
    }
    yield made
    for llm in made.values():
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_constrained_outputs_equal_the_synchronous_engines(
    engines: dict[bool, LLM], fed: dict[tuple[str, int], list[int]], seeded: bool
) -> None:
    expected = drive(engines[False], mixed(seeded))
    fed.clear()
    got = drive(engines[True], mixed(seeded))
    assert list(got.values()) == list(expected.values())
    reasons = {reason for completions in got.values() for _, reason in completions}
    assert {"stop", "length"} <= reasons
    assert_matchers_took_the_kept_tokens(got, fed)
    if engines[True].llm_engine.config.cache_config.block_size == 4:  # "preempting"
        assert engines[True].llm_engine.stats()["num_preemptions"] > 0


def test_an_abort_mid_way_changes_nothing_else(
    engines: dict[bool, LLM], fed: dict[tuple[str, int], list[int]]
) -> None:
    """The JSON request is aborted after its third token: with async scheduling its fourth is
    drawn already (the step in flight), and is dropped; its matcher never takes it."""
    abort_at = {0: 3}
    expected = drive(engines[False], mixed(False), abort_at)
    fed.clear()
    got = drive(engines[True], mixed(False), abort_at)
    assert list(got.values()) == list(expected.values())
    aborted = next(iter(got))
    assert len(got[aborted][0][0]) == 3 and got[aborted][0][1] is None
    assert_matchers_took_the_kept_tokens(got, fed, frozenset({aborted}))


class _Observed:
    """A launched forward pass whose `sample` notes whether a step is in flight then."""

    def __init__(self, forward: LaunchedForward, notes: list[tuple[str, bool]], llm: LLM) -> None:
        self._forward = forward
        self._notes = notes
        self._pipeline = llm.llm_engine.engine_core.pipeline

    def sample(self, token_bitmask: TokenBitmask | None) -> AsyncStepOutput:
        self._notes.append(("sample", self._pipeline.busy))
        return self._forward.sample(token_bitmask)


@pytest.mark.parametrize("overlap", [True, False], ids=["async", "sync"])
def test_constrained_steps_launch_while_the_step_before_is_in_flight(
    engines: dict[bool, LLM], monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """With async scheduling each constrained decode step's forward pass is launched while the
    step before is in flight (not read back), and its draws only once that one is read back;
    the synchronous engine has read every step back before it launches the next."""
    llm = engines[overlap]
    core = llm.llm_engine.engine_core
    notes: list[tuple[str, bool]] = []
    launch_forward = core.executor.launch_forward

    def observed(plan: StepPlan) -> LaunchedForward:
        notes.append(("forward", core.pipeline.busy))
        return _Observed(launch_forward(plan), notes, llm)

    monkeypatch.setattr(core.executor, "launch_forward", observed)
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=PERSON)] * 3
    drive(llm, params)
    forwards = [busy for kind, busy in notes if kind == "forward"]
    assert [kind for kind, _ in notes] == ["forward", "sample"] * len(forwards)
    assert not any(busy for kind, busy in notes if kind == "sample")
    overlapped = sum(forwards)
    if overlap:
        assert overlapped >= len(forwards) - 3 and len(forwards) >= 20
    else:
        assert overlapped == 0


def test_ranks_in_other_processes_get_complete_plans(model_dir: Path) -> None:
    """Tensor parallelism (the multiprocess executor, whose ranks take only complete plans):
    a constrained step runs whole once its bitmask is known, every rank sampling under it, and
    the outputs are one rank's. (One engine at a time: the second rank's group is global.)"""
    outputs = []
    for size in (1, 2):
        llm = LLM(
            str(model_dir),
            device="cpu",
            max_model_len=256,
            tensor_parallel_size=size,
            kv_cache_memory_bytes=1 << 22,
        )
        try:
            outputs.append(list(drive(llm, mixed(False)).values()))
        finally:
            llm.llm_engine.shutdown()
    assert outputs[1] == outputs[0]
