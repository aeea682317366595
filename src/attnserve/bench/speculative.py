"""`attnserve bench speculative`: speculative decoding against none, on prompts where drafts
pay off — asking the model to repeat or edit a text it was given.

Two engines of the same arguments are run one after the other, the first without speculation
(the baseline), the second with `--speculative-config` (required); each takes a warm-up, then
`--num-prompts` requests in batches of `--batch-size` (1: single stream), greedy, `--output-len`
tokens each at most (EOS ends a request). With a tokenizer the prompts are chat requests to
repeat or lightly edit one of a few texts; without one (dummy presets), each prompt is a random
block of token ids given twice. It prints each engine's output tokens per second, their ratio,
the acceptance figures, and whether every output equals the baseline's (greedy speculation
must not change a token).
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
from attnserve.engine.arg_utils import EngineArgs
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


def _run(llm: LLM, prompts: list[Any], args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Output tokens per second over the prompts, in batches of --batch-size, and the
    speculation figures of the timed part; each output's token ids."""
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    llm.generate(prompts[: args.batch_size], params, use_tqdm=False)  # warm-up
    outputs, tokens = [], 0
    before = llm.llm_engine.stats()
    sync()
    started = time.perf_counter()
    for start in range(0, len(prompts), args.batch_size):
        batch = llm.generate(prompts[start : start + args.batch_size], params, use_tqdm=False)
        outputs += [o.outputs[0].token_ids for o in batch]
        tokens += sum(len(o.outputs[0].token_ids) for o in batch)
    sync()
    rate = tokens / (time.perf_counter() - started)
    figures = spec_decode_figures(before, llm.llm_engine.stats())
    return {"output_tokens_per_s": rate, **figures}, outputs


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the module docstring."""
    check_output_files(args, "json")
    check_positive(args, "num_prompts", "batch_size", "output_len")
    speculative = EngineArgs.from_cli_args(args)
    if speculative.speculative_config is None:
        raise ValueError("--speculative-config is required (the configuration to measure)")
    speculative.create_engine_config()  # a bad configuration fails before any run
    result: dict[str, Any] = {}
    outputs = {}
    for name, engine_args in (
        ("baseline", dataclasses.replace(speculative, speculative_config=None)),
        ("speculative", speculative),
    ):
        progress(f"loading the {name} engine")
        llm = LLM.from_engine_args(engine_args)
        try:
            prompts = _prompts(llm, args.num_prompts, args.seed)
            progress(f"{name}: {len(prompts)} prompts, batches of {args.batch_size}")
            figures, outputs[name] = _run(llm, prompts, args)
            rate = figures.pop("output_tokens_per_s")
            result |= {f"{name}_output_tokens_per_s": rate, **figures}
        finally:
            llm.shutdown()
    result["speedup"] = (
        result["speculative_output_tokens_per_s"] / (result["baseline_output_tokens_per_s"])
    )
    result["outputs_identical"] = outputs["speculative"] == outputs["baseline"]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, default=6, help="requests to time")
    parser.add_argument("--batch-size", type=int, default=1, help="requests at once")
    parser.add_argument("--output-len", type=int, default=128, help="most tokens per request")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
