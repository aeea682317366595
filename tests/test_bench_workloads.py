"""The named workload kinds: the standard one is `bench throughput`'s own draw, the chat-like one
is long-tailed, every kind is seeded, and a bad kind or combination is refused by name."""

from __future__ import annotations

import argparse
import statistics

import pytest

from attnserve.bench.throughput import _check, make_workload
from attnserve.bench.workloads import KINDS, draw_workload

VOCAB = 151936  # Qwen3's


def _flags(**overrides: object) -> argparse.Namespace:
    flags = {
        "seed": 0, "min_len": 100, "max_len": 1024, "input_len": None, "output_len": None,
        "shared_prefix": 0, "num_prompts": 256, "workload": None, "batch_sizes": [],
        "profile_steps": 0, "plot": None, "json": None,
    }  # fmt: skip
    return argparse.Namespace(**(flags | overrides))


def test_standard_kind_is_the_benchmarks_default_draw() -> None:
    standard = draw_workload("standard", VOCAB)
    assert standard == make_workload(_flags(), VOCAB)
    assert standard.output_tokens == 144_141  # the figure docs/benchmarks.md quotes


def test_chat_kind_has_long_tails_in_both_lengths() -> None:
    chat = draw_workload("chat", VOCAB)
    prompts, outputs = sorted(chat.input_lens), sorted(chat.output_lens)
    assert len(prompts) == 512
    assert prompts[-1] > 8 * statistics.median(prompts) and prompts[-1] <= 6144
    assert outputs[-1] > 8 * statistics.median(outputs) and outputs[-1] <= 2048
    assert min(prompts) >= 8 and min(outputs) >= 8


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_seeded_and_in_the_vocabulary(kind: str) -> None:
    first, second = draw_workload(kind, 1000), draw_workload(kind, 1000)
    assert first == second
    assert all(0 <= token < 1000 for prompt in first.prompts for token in prompt)


def test_long_and_prefix_kinds_keep_their_shapes() -> None:
    long = draw_workload("long", VOCAB)
    assert all(4096 <= n <= 6144 for n in long.input_lens)
    assert all(16 <= n <= 64 for n in long.output_lens)
    prefix = draw_workload("prefix", VOCAB)
    assert len({tuple(p[:2048]) for p in prefix.prompts}) == 1


def test_workload_flag_replaces_the_length_flags() -> None:
    assert make_workload(_flags(workload="long", num_prompts=3), VOCAB) == draw_workload(
        "long", VOCAB
    )


def test_unknown_kind_and_a_swept_kind_are_refused() -> None:
    with pytest.raises(ValueError, match="workload kind must be one of"):
        draw_workload("bursty", VOCAB)
    with pytest.raises(ValueError, match="--batch-sizes"):
        _check(_flags(workload="chat", batch_sizes=[16]))
