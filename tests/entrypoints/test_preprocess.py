"""The preprocessing pool and the prompt bound, in-process: the pool runs at most its threads'
worth of jobs, keeps a thread for small jobs while large ones queue, and holds a job's slot until
its thread is done with it (not until its caller leaves); `prompt_bound` is sound on the default
model's tokenizer (a text it judges too long has more tokens than that, for texts made of the
tokenizer's longest tokens, special tokens, the characters it drops and more) and refuses to
guess for tokenizers it cannot bound."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from attnserve.entrypoints.openai.preprocess import LARGE_JOB_BYTES, PreprocessPool
from attnserve.entrypoints.openai.prompt_bound import byte_level_alphabet, prompt_bound
from tests.conftest import HANG_GUARD_S


class _Jobs:
    """Jobs that block until released, recording which run and the most that ran at once."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.peak = 0
        self.release = threading.Event()
        self._lock = threading.Lock()

    def job(self, name: str) -> str:
        with self._lock:
            self.running.append(name)
            self.peak = max(self.peak, len(self.running))
        self.release.wait(HANG_GUARD_S)
        with self._lock:
            self.running.remove(name)
        return name


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, "a hang"
        await asyncio.sleep(0.01)


def test_pool_bounds_its_jobs_and_keeps_a_thread_for_small_ones() -> None:
    async def run() -> list[str]:
        pool, jobs = PreprocessPool(3), _Jobs()
        large = [pool.run(LARGE_JOB_BYTES, jobs.job, f"large{i}") for i in range(4)]
        tasks = [asyncio.ensure_future(job) for job in large]
        await _until(lambda: len(jobs.running) == 2)  # threads - 1 large jobs at once
        small = [asyncio.ensure_future(pool.run(10, jobs.job, f"small{i}")) for i in range(3)]
        await _until(lambda: "small0" in jobs.running)  # the thread kept for small jobs
        assert sorted(jobs.running) == ["large0", "large1", "small0"]
        jobs.release.set()
        done = await asyncio.gather(*tasks, *small)
        pool.shutdown()
        assert jobs.peak == 3
        return done

    assert asyncio.run(run()) == [*(f"large{i}" for i in range(4)), "small0", "small1", "small2"]


def test_a_job_whose_caller_left_keeps_its_slot_until_its_thread_is_done() -> None:
    async def run() -> None:
        pool, jobs = PreprocessPool(1), _Jobs()
        first = asyncio.ensure_future(pool.run(10, jobs.job, "first"))
        await _until(lambda: jobs.running == ["first"])
        first.cancel()
        second = asyncio.ensure_future(pool.run(10, jobs.job, "second"))
        for _ in range(100):  # the second would start now if the first's slot were free
            await asyncio.sleep(0)
        assert jobs.running == ["first"]
        jobs.release.set()
        assert await second == "second"
        assert first.cancelled() and jobs.peak == 1
        pool.shutdown()

    asyncio.run(run())


def test_a_failing_job_raises_to_its_caller() -> None:
    async def run() -> None:
        pool = PreprocessPool(1)
        with pytest.raises(ValueError, match="bad"):
            await pool.run(10, int, "bad")
        assert await pool.run(10, int, "7") == 7  # its slot is free again
        pool.shutdown()

    asyncio.run(run())


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        PreprocessPool(0)


MAX_TOKENS = 4
PIECES = ["hello ", " ", "\n", "#" * 80, "<|im_start|>", "<|endoftext|>", "é", "世界", "🙂", "\x04"]


@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=400))
def test_a_text_the_bound_judges_too_long_has_more_tokens(tokenizer: Any, parts: list[str]) -> None:
    text = "".join(parts)
    bound = prompt_bound(tokenizer)
    assert bound is not None
    if bound.cannot_fit(text, MAX_TOKENS):
        assert len(tokenizer.encode(text)) > MAX_TOKENS


def test_the_default_tokenizers_bound(tokenizer: Any) -> None:
    bound = prompt_bound(tokenizer)
    assert bound is not None
    assert bound.chars_per_token == max(map(len, tokenizer.get_vocab()))
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest]) * (MAX_TOKENS + 1)
    assert bound.cannot_fit(text, MAX_TOKENS)
    assert not bound.cannot_fit(text, MAX_TOKENS + 1)
    for dropped in bound.dropped_ascii:  # characters it has no token for: not judged early
        assert tokenizer.encode(dropped * 10, add_special_tokens=False) == []
    assert not bound.cannot_fit("\x04" * 10_000, MAX_TOKENS)


def _fast(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _byte_level_bpe(normalizer: Any = None, pre_tokenizer: Any = None) -> Tokenizer:
    vocab = {char: i for i, char in enumerate(byte_level_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel()
    if normalizer is not None:
        backend.normalizer = normalizer
    return backend


def test_a_byte_level_bpe_with_every_byte_is_bounded() -> None:
    bound = prompt_bound(_fast(_byte_level_bpe()))
    assert bound is not None
    assert (bound.chars_per_token, bound.dropped_ascii, bound.drops_non_ascii) == (1, "", False)


@pytest.mark.parametrize(
    "backend",
    [
        Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
        _byte_level_bpe(normalizer=normalizers.Strip()),
        _byte_level_bpe(normalizer=normalizers.Replace("  ", " ")),
        _byte_level_bpe(
            pre_tokenizer=pre_tokenizers.Sequence(
                [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()]
            )
        ),
        Tokenizer(models.BPE(vocab={"a": 0}, merges=[])),  # no byte tokens: drops the rest
    ],
    ids=["wordpiece", "strip", "shortening-replace", "whitespace-split", "no-bytes"],
)
def test_no_bound_where_the_tokenizer_can_shorten_text(backend: Tokenizer) -> None:
    assert prompt_bound(_fast(backend)) is None


def test_no_bound_without_a_fast_tokenizer() -> None:
    assert prompt_bound(None) is None
