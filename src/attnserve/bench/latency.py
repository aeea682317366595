"""`attnserve bench latency`: the latency of one batch, as vLLM's benchmark_latency measures it.

A batch of `--batch-size` requests of `--input-len` random token ids, each asking for exactly
`--output-len` tokens (greedy, `ignore_eos`), submitted at once; one warm-up, then
`--num-iters` iterations. Each iteration runs the batch twice on fresh prompts (so the prefix
cache cannot help): with max_tokens=1, whose time is the prefill time (time to the batch's first
token), then in full, whose time is the end-to-end latency. Time per output token =
(end-to-end − prefill) / (output len − 1), per iteration.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import numpy as np

from attnserve.bench.common import Workload, print_scalars, progress, run_engine, write_json
from attnserve.engine.arg_utils import EngineArgs
from attnserve.entrypoints.llm import LLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def _check(args: argparse.Namespace) -> None:
    for flag in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def _ms_summary(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the module docstring."""
    _check(args)
    progress("loading the engine")
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(args.seed)

    def batch(output_len: int) -> Workload:
        """Fresh random prompts, each asking for `output_len` tokens."""
        length, size = args.input_len, args.batch_size
        prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(size)]
        return Workload(prompts, [output_len] * size)

    progress("warm-up")
    run_engine(llm, batch(args.output_len))
    prefill, e2e = [], []
    for iteration in range(args.num_iters):
        progress(f"iteration {iteration + 1} of {args.num_iters}")
        prefill.append(run_engine(llm, batch(1)))
        e2e.append(run_engine(llm, batch(args.output_len)))
    result: dict[str, Any] = {
        "model": llm.llm_engine.model_config.model,
        "device": str(llm.llm_engine.config.device),
        "backend": llm.llm_engine.executor.driver_runner.backend.get_name(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    result |= _ms_summary("prefill", prefill)
    if args.output_len > 1:
        tpot = [(e - p) / (args.output_len - 1) for e, p in zip(e2e, prefill, strict=True)]
        result |= _ms_summary("tpot", tpot)
    return result | _ms_summary("e2e_latency", e2e) | {"e2e_latencies_s": e2e}


def main(args: argparse.Namespace) -> int:
    result = benchmark(args)
    print_scalars(result)
    if args.json:
        write_json(args.json, result, args)
    return 0
