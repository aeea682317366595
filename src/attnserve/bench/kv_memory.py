"""`attnserve bench kv-memory`: the KV-cache memory one sequence holds at a long context.

One request of `--context` random prompt tokens, then `--output-len` tokens (greedy,
`ignore_eos`), alone in the engine and without prefix caching, so every block in use is its
own. Between steps: the blocks held (all KV-cache groups), times the bytes a block takes
across the cache tensors. Reported: the most held between steps and what it holds while it
decodes at the full context (while a prompt chunk is computed, each window group also holds
that chunk's blocks, freed behind the window once it is done).
With `--disable-hybrid-kv-cache-manager` every layer keeps every block: the figure to compare
a model with sliding-window layers against.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from attnserve.bench.common import check_output_files, check_positive, progress, report
from attnserve.config import EngineArgs
from attnserve.engine.llm_engine import LLMEngine
from attnserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=8, help="tokens decoded after it")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main, enable_prefix_caching=False)


def blocks_held(engine: LLMEngine, context: int, output_len: int) -> tuple[int, int]:
    """(peak, while decoding) blocks held by one request of `context` random tokens and
    `output_len` greedy tokens; nothing else may run in `engine`."""
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(context)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    num_blocks = engine.executor.driver_runner.num_blocks
    engine.add_request("kv-memory", prompt, params)
    peak = decoding = 0
    while engine.has_unfinished_requests():
        finished = any(output.finished for output in engine.step())
        held = round(engine.stats()["kv_cache_usage"] * num_blocks)
        peak = max(peak, held)
        if not finished:
            decoding = held
    return peak, decoding


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    check_positive(args, "context", "output_len")
    check_output_files(args, "json")
    progress("loading the engine")
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        runner = engine.executor.driver_runner
        per_block = runner.bytes_per_block()
        progress(f"one request of {args.context} tokens")
        peak, decoding = blocks_held(engine, args.context, args.output_len)
        return {
            "model": engine.model_config.model,
            "context": args.context,
            "kv_cache_groups": len(runner.kv_cache_windows),
            "kv_bytes_per_block": per_block,
            "peak_blocks": peak,
            "decode_blocks": decoding,
            "peak_kv_gib": peak * per_block / 2**30,
            "decode_kv_gib": decoding * per_block / 2**30,
        }
    finally:
        engine.shutdown()


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
