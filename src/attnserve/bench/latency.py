"""`attnserve bench latency`: the latency of one batch, after vLLM's benchmark_latency.

A batch of `--batch-size` requests of `--input-len` random token ids, each asking for exactly
`--output-len` tokens (greedy, `ignore_eos`), submitted at once; one warm-up, then
`--num-iters` iterations, each on fresh prompts (so the prefix cache cannot help). Every figure
comes from the same requests, streamed through the engine: each request's first-token and
last-token times (when the engine hands them out), from the batch's submission. Per iteration:
prefill = when the last request of the batch got its first token, end-to-end = when the last
request finished, time per output token = the mean over requests of (last − first token time) /
(output len − 1), as vLLM's serving benchmark computes TPOT.

With TPOT, its bound (bench/bound.py, at the copy bandwidth and matmul rate measured first in the
same run): the batch's decode steps 1 .. output len − 1, each reading every weight it needs
(`ModelShape.step_weight_bytes` of the batch) and the K and V of every sequence's context, and
taking max(bytes / copy rate, FLOPs / matmul rate); their mean, against the median TPOT.

With `--num-loras N` (and `--enable-lora`), the batch's requests take N random LoRA adapters of
`--lora-rank` in turn (bench/lora.py), each read in the warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnserve.bench.bound import ModelShape, Rates, measure_rates, workload_bound
from attnserve.bench.common import (
    check_output_files,
    check_positive,
    progress,
    report,
    spec_decode_figures,
    sync,
)
from attnserve.bench.lora import add_lora_arguments, random_lora_requests
from attnserve.config import EngineArgs
from attnserve.engine.llm_engine import LLMEngine
from attnserve.lora.request import LoRARequest
from attnserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BatchTimes:
    """One batch's requests' first-token and last-token times, in s from its submission."""

    first: list[float]
    last: list[float]

    @property
    def prefill(self) -> float:
        return max(self.first)

    @property
    def e2e(self) -> float:
        return max(self.last)

    def tpot(self, output_len: int) -> float:
        return statistics.fmean(
            (last - first) / (output_len - 1)
            for first, last in zip(self.first, self.last, strict=True)
        )


_request_ids = itertools.count()


def time_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    loras: tuple[LoRARequest, ...] = (),
) -> BatchTimes:
    """Run `prompts` at once (greedy, `ignore_eos`, `output_len` tokens each; request i with
    LoRA adapter i of `loras` in turn, if any), streamed, and note when each request's first
    and last tokens come out."""
    params = SamplingParams(
        temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    ids = [f"latency-{next(_request_ids)}" for _ in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    sync()
    started = time.perf_counter()
    for i, (request_id, prompt) in enumerate(zip(ids, prompts, strict=True)):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(request_id, prompt, params, lora_request=lora)
    while len(last) < len(ids):
        outputs = engine.step()
        now = time.perf_counter() - started
        for output in outputs:
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, now)
            if output.finished:
                last[output.request_id] = now
    return BatchTimes([first[i] for i in ids], [last[i] for i in ids])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    add_lora_arguments(parser)
    parser.set_defaults(handler=main)


def _check(args: argparse.Namespace) -> None:
    check_positive(args, "batch_size", "input_len", "output_len", "num_iters")
    check_output_files(args, "json")


def _ms_summary(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms),
        f"median_{name}_ms": statistics.median(ms),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


BOUND_RULE = "each decode step of the batch: max(bytes / copy rate, FLOPs / matmul rate)"


def tpot_bound(args: argparse.Namespace, shape: ModelShape, rates: Rates) -> dict[str, Any]:
    """The bound of a batch's TPOT: its decode steps' mean time under the bound's rule."""
    batch = args.batch_size
    bound = workload_bound(shape, [args.input_len] * batch, [args.output_len] * batch, rates)
    return {
        "bound_tpot_ms": bound.decode_s / bound.decode_steps * 1000,
        "bound_memory_bound_step_share": bound.memory_bound_steps / bound.decode_steps,
        "bound_rule": BOUND_RULE,
        **rates.figures(),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the module docstring."""
    _check(args)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    model_config, device = config.model_config, config.device
    progress(f"measuring copy bandwidth and {model_config.dtype} matmul rate on {device}")
    rates = measure_rates(device, model_config.dtype)
    progress("loading the engine")
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        result = _figures(engine, args)
    finally:
        engine.shutdown()
    if args.output_len < 2:
        return result
    shape = ModelShape.from_config(model_config, engine_args.kv_cache_dtype)
    result |= tpot_bound(args, shape, rates)
    result["tpot_fraction_of_bound"] = result["bound_tpot_ms"] / result["median_tpot_ms"]
    return result


def _figures(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)

    def prompts() -> list[list[int]]:
        """A fresh batch of random prompts."""
        length, size = args.input_len, args.batch_size
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(size)]

    loras = tuple(random_lora_requests(args, engine.model_config))
    progress("warm-up")
    warm_up = prompts()
    if loras:  # one request per adapter: each is read from disk now
        time_batch(engine, warm_up[:1] * len(loras), 2, loras)
    time_batch(engine, warm_up, args.output_len, loras)
    before = engine.stats()
    batches = []
    for iteration in range(args.num_iters):
        progress(f"iteration {iteration + 1} of {args.num_iters}")
        batches.append(time_batch(engine, prompts(), args.output_len, loras))
    e2e = [b.e2e for b in batches]
    result: dict[str, Any] = {
        "model": engine.model_config.model,
        "device": str(engine.config.device),
        "backend": engine.executor.driver_runner.backend.get_name(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        **({"num_loras": args.num_loras, "lora_rank": args.lora_rank} if loras else {}),
    }
    result |= _ms_summary("prefill", [b.prefill for b in batches])
    if args.output_len > 1:
        result |= _ms_summary("tpot", [b.tpot(args.output_len) for b in batches])
    result |= spec_decode_figures(before, engine.stats())
    return result | _ms_summary("e2e_latency", e2e) | {"e2e_latencies_s": e2e}


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
