"""Tensor parallelism end to end on CPU: gloo, one process per rank (the "mp" executor).

Greedy tokens at TP=2 equal TP=1's on a dummy model (chunked prefill, log-probabilities too),
equal HF transformers' on a sharded safetensors checkpoint, and TP=3 equals TP=1 on the embedded
default model (9 query / 3 KV heads: 3 is the smallest degree > 1 that divides them; TP=2 is a
ValueError). A worker killed mid-run makes the engine raise a RuntimeError naming it (not hang)
and leaves no process behind; workers exit when the engine process dies.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import signal
import subprocess
import sys
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest

from attnserve import LLM, SamplingParams
from tests.conftest import HANG_GUARD_S, hf_greedy, wait_until

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def token_ids(prompts: list[Any], params: SamplingParams = GREEDY, **engine: Any) -> list[Any]:
    """Each prompt's output (token ids and log-probs) from a fresh engine, shut down after."""
    llm = LLM(device="cpu", dtype="float32", **engine)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]
    finally:
        llm.shutdown()


def random_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def assert_logprobs_close(got: Any, want: Any) -> None:
    assert (got is None) == (want is None)
    for got_row, want_row in zip(got or [], want or [], strict=True):
        if want_row is None:
            assert got_row is None
            continue
        assert got_row.keys() == want_row.keys()
        for token, value in want_row.items():
            assert got_row[token].logprob == pytest.approx(value.logprob, abs=1e-4)


def test_tp2_matches_tp1_on_a_dummy_model() -> None:
    prompts = random_prompts(512, (3, 17, 40, 9, 64))
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    engine = {"model": "llama-tiny", "load_format": "dummy", "max_num_batched_tokens": 48}
    tp1 = token_ids(prompts, params, **engine)
    tp2 = token_ids(prompts, params, tensor_parallel_size=2, **engine)
    assert [t for t, _, _ in tp2] == [t for t, _, _ in tp1]
    assert all(len(t) == NEW_TOKENS for t, _, _ in tp1)
    for (_, got_lp, got_plp), (_, want_lp, want_plp) in zip(tp2, tp1, strict=True):
        assert_logprobs_close(got_lp, want_lp)
        assert_logprobs_close(got_plp, want_plp)


def test_tp2_sharded_safetensors_matches_hf(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(380, (5, 23, 11))
    expected = [hf_greedy(tiny_llama_dir, p, NEW_TOKENS) for p in prompts]
    got = token_ids(prompts, model=str(tiny_llama_dir), tensor_parallel_size=2)
    assert [t for t, _, _ in got] == expected


def test_tp3_matches_tp1_on_the_default_model() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tp1 = token_ids(prompts, short, max_model_len=256)
    tp3 = token_ids(prompts, short, max_model_len=256, tensor_parallel_size=3)
    assert [t for t, _, _ in tp3] == [t for t, _, _ in tp1]


def test_a_dead_worker_fails_the_engine_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", tensor_parallel_size=2)
    executor = llm.llm_engine.executor
    worker = executor.processes[0]  # type: ignore[attr-defined]
    steps = itertools.count()
    execute = executor.execute_model

    def dies_at_step_5(batch: Any) -> Any:  # mid-run, at the same point every time
        if next(steps) == 5:
            os.kill(worker.pid, signal.SIGKILL)
            wait([worker.sentinel])  # dead (the executor's monitor reaps it, as in real life)
        return execute(batch)

    monkeypatch.setattr(executor, "execute_model", dies_at_step_5)
    long_run = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    try:
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
            llm.generate([[5, 6, 7]] * 4, long_run, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not worker.is_alive()
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="worker rank 1"):
        executor.check_health()


DRIVER_SCRIPT = """
import os, signal
from attnserve import LLM
if __name__ == "__main__":
    llm = LLM("llama-tiny", load_format="dummy", device="cpu", tensor_parallel_size=2)
    print(llm.llm_engine.executor.processes[0].pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()  # a zombie is dead
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_engine_process_dies(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", ".", *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker_pid = int(done.stdout.split()[0])
    wait_until(lambda: _gone(worker_pid), f"worker {worker_pid} to exit")
