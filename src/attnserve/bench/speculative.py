"""`attnserve bench speculative`: speculative decoding against none, on prompts where drafts
pay off — asking the model to repeat or edit a text it was given.

Two engines of the same arguments run side by side, one without speculation (the baseline), one
with `--speculative-config` (required); on a GPU the baseline takes half of
`--gpu-memory-utilization` and the speculative engine the rest. Each takes a warm-up, then
`--num-prompts` requests in batches of `--batch-size` (1: single stream), greedy, `--output-len`
tokens each at most (EOS ends a request); the two engines take each batch in turn (in
alternating order), so a machine whose speed drifts during the run slows both alike. With a
tokenizer the prompts are chat requests to repeat or lightly edit one of a few texts; without one
(dummy presets), each prompt is a random block of token ids given twice. It prints each
engine's output tokens per second, their ratio, the acceptance figures, and whether every output
equals the baseline's (greedy speculation must not change a token).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from typing import Any

from attnserve.bench.common import (
    check_output_files,
    check_positive,
    progress,
    report,
    spec_decode_figures,
    sync,
)
from attnserve.config import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.sampling_params import SamplingParams

TEXTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can "
    "of oil and a rag. He polished the great lens until it shone, trimmed the wick, and watched "
    "the beam sweep across the dark water, counting the ships that passed safely below.",
    "To make bread, mix flour, water, salt and yeast into a soft dough. Knead it for ten "
    "minutes, let it rise in a warm place for an hour, shape it into a loaf, let it rise again, "
    "and bake it in a hot oven until the crust is brown and it sounds hollow when tapped.",
    "def moving_average(values, window):\n    averages = []\n    total = 0.0\n    for i, value "
    "in enumerate(values):\n        total += value\n        if i >= window:\n            total "
    "-= values[i - window]\n        averages.append(total / min(i + 1, window))\n    return "
    "averages\n",
)
ASKS = (
    "Repeat the following text exactly, with nothing before or after it:\n\n{text}",
    "Rewrite the following text with every sentence kept, changing only its first word:\n\n{text}",
)


def _prompts(llm: LLM, count: int, seed: int) -> list[Any]:
    """`count` prompts: chat requests to repeat or edit a text, or without a tokenizer random
    token blocks given twice."""
    tokenizer = llm.llm_engine.tokenizer
    if tokenizer is None:
        rng, vocab = random.Random(seed), llm.llm_engine.model_config.vocab_size
        blocks = ([rng.randrange(vocab) for _ in range(64)] for _ in range(count))
        return [block * 2 for block in blocks]
    texts = [ask.format(text=text) for text in TEXTS for ask in ASKS]
    messages = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(count)]
    if tokenizer.chat_template is None:
        return [m[0]["content"] for m in messages]
    return [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        for m in messages
    ]


def _timed_batches(
    engines: dict[str, LLM], prompts: list[Any], params: SamplingParams, batch_size: int
) -> dict[str, tuple[float, list[Any]]]:
    """Each engine's seconds over all batches and each output's token ids, the engines taking
    each batch in turn."""
    seconds = dict.fromkeys(engines, 0.0)
    outputs: dict[str, list[Any]] = {name: [] for name in engines}
    for index, start in enumerate(range(0, len(prompts), batch_size)):
        names = list(engines) if index % 2 == 0 else list(engines)[::-1]
        for name in names:
            sync()
            started = time.perf_counter()
            batch = engines[name].generate(
                prompts[start : start + batch_size], params, use_tqdm=False
            )
            sync()
            seconds[name] += time.perf_counter() - started
            outputs[name] += [o.outputs[0].token_ids for o in batch]
    return {name: (seconds[name], outputs[name]) for name in engines}


def _engine_args(args: argparse.Namespace) -> dict[str, EngineArgs]:
    """The baseline's and the speculative engine's arguments (the baseline with half of the
    GPU memory share: the speculative engine, started second, takes what is left of it)."""
    speculative = EngineArgs.from_cli_args(args)
    if speculative.speculative_config is None:
        raise ValueError("--speculative-config is required (the configuration to measure)")
    speculative.create_engine_config()  # a bad configuration fails before any run
    baseline = dataclasses.replace(
        speculative,
        speculative_config=None,
        gpu_memory_utilization=speculative.gpu_memory_utilization / 2,
    )
    return {"baseline": baseline, "speculative": speculative}


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the module docstring."""
    check_output_files(args, "json")
    check_positive(args, "num_prompts", "batch_size", "output_len")
    engines: dict[str, LLM] = {}
    try:
        for name, engine_args in _engine_args(args).items():
            progress(f"loading the {name} engine")
            engines[name] = LLM.from_engine_args(engine_args)
        prompts = _prompts(engines["baseline"], args.num_prompts, args.seed)
        progress(f"{len(prompts)} prompts, batches of {args.batch_size}, the engines in turn")
        params = SamplingParams(temperature=0, max_tokens=args.output_len)
        for llm in engines.values():
            llm.generate(prompts[: args.batch_size], params, use_tqdm=False)  # warm-up
        before = engines["speculative"].llm_engine.stats()
        timed = _timed_batches(engines, prompts, params, args.batch_size)
        figures = spec_decode_figures(before, engines["speculative"].llm_engine.stats())
    finally:
        for llm in engines.values():
            llm.shutdown()
    rates = {
        name: sum(len(tokens) for tokens in outputs) / seconds
        for name, (seconds, outputs) in timed.items()
    }
    return {
        "baseline_output_tokens_per_s": rates["baseline"],
        "speculative_output_tokens_per_s": rates["speculative"],
        **figures,
        "speedup": rates["speculative"] / rates["baseline"],
        "outputs_identical": timed["speculative"][1] == timed["baseline"][1],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, default=6, help="requests to time")
    parser.add_argument("--batch-size", type=int, default=1, help="requests at once")
    parser.add_argument("--output-len", type=int, default=128, help="most tokens per request")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
