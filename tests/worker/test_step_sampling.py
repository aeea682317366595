"""A step in two halves (`ModelRunner.launch_forward`, then `ForwardPass.sample` with the token
bitmask): the same draws as the step launched whole with that bitmask in its plan, a next step
reading them on the device before they are read back; a step's draws are launched once, and no
step is launched while the one before waits for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.step_types import NewSequence, StepPlan, StepResults, TokenBitmask
from attnserve.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)
ONLY = 42  # the one token the bitmask allows the second sequence


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> Iterator[ModelRunner]:
    """An idle engine's runner, for plans of sequences the engine does not know."""
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        max_model_len=64,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 22,
    )
    yield llm.llm_engine.executor.driver_runner
    llm.llm_engine.shutdown()


def _only(token: int, vocab_size: int) -> TokenBitmask:
    """A bitmask constraining the step's second sampling sequence to `token`."""
    words = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)
    bit = 1 << (token % 32)
    words[0, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
    return TokenBitmask([1], words)


def _steps(runner: ModelRunner, halves: bool, first_id: int) -> list[StepResults]:
    """A prefill of two sequences, then a decode of both (reading the prefill's draws on the
    device), its second sequence constrained; both launched before either is read back."""
    prefill = StepPlan.of_new(
        [
            NewSequence(first_id, [5, 9, 2, 7, 1], 5, 0, [0], GREEDY),
            NewSequence(first_id + 1, [3, 3, 8], 3, 0, [1], GREEDY),
        ]
    )
    decode = StepPlan([first_id, first_id + 1], [1, 1])
    bitmasks = [None, _only(ONLY, runner.model_config.vocab_size)]
    launched = []
    for plan, bitmask in zip([prefill, decode], bitmasks, strict=True):
        if halves:
            launched.append(runner.launch_forward(plan).sample(bitmask))
        else:
            launched.append(runner.execute_async(dataclasses.replace(plan, token_bitmask=bitmask)))
    results = [future.result() for future in launched]
    runner.input_batch.release([first_id, first_id + 1])
    return results


def test_two_halves_draw_what_the_whole_step_draws(runner: ModelRunner) -> None:
    whole = _steps(runner, halves=False, first_id=10_000)
    halves = _steps(runner, halves=True, first_id=10_002)
    assert halves == whole
    decode = whole[1]
    assert decode[1] is not None and decode[1].token_ids == [ONLY]


def test_a_step_is_sampled_once_and_before_the_next_is_launched(runner: ModelRunner) -> None:
    plan = StepPlan.of_new([NewSequence(20_000, [4, 8, 15], 3, 0, [0], GREEDY)])
    forward = runner.launch_forward(plan)
    with pytest.raises(RuntimeError, match="before the step before it was sampled"):
        runner.launch_forward(StepPlan.of_new([NewSequence(20_001, [16], 1, 0, [1], GREEDY)]))
    (drawn,) = forward.sample(None).result()
    assert drawn is not None and len(drawn.token_ids) == 1
    with pytest.raises(RuntimeError, match="launched already"):
        forward.sample(None)
    runner.input_batch.release([20_000])
