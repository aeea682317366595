"""`attnserve bench throughput`: offline generation throughput, baselines measured in the same run.

Workloads: N requests of random token ids with fixed input/output lengths, or lengths uniform in
[min, max] (nano-vllm's offline benchmark: 256 requests, 100..1024, seed 0), `ignore_eos`, all
submitted at once, after one warm-up. Optional baselines in the same run: HF transformers
`generate` on exactly the same weights (static batches), and, with `--shared-prefix`, the same
engine with prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from attnserve.engine.arg_utils import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Random prompts (a shared prefix first, when asked) and output lengths, seeded."""
    rng = random.Random(args.seed)

    def length(fixed: int | None) -> int:
        return fixed if fixed is not None else rng.randint(args.min_len, args.max_len)

    prefix = [rng.randrange(vocab_size) for _ in range(args.shared_prefix)]
    prompts, outputs = [], []
    for _ in range(args.num_prompts):
        prompts.append(prefix + [rng.randrange(vocab_size) for _ in range(length(args.input_len))])
        outputs.append(length(args.output_len))
    return Workload(prompts, outputs)


def run_engine(llm: LLM, workload: Workload) -> float:
    """Seconds for one `generate` of the whole workload (greedy, ignore_eos)."""
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    _sync()
    started = time.perf_counter()
    llm.generate(workload.prompts, params, use_tqdm=False)
    _sync()
    return time.perf_counter() - started


def run_hf(llm: LLM, workload: Workload, batch_size: int) -> float:
    """Seconds for HF `generate` over the workload in static, left-padded batches."""
    from attnserve.model.hf_export import to_hf_model

    engine = llm.llm_engine
    hf = to_hf_model(engine.runner.model, engine.model_config)
    hf.generation_config.eos_token_id = None
    _sync()
    started = time.perf_counter()
    for start in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[start : start + batch_size]
        longest = max(map(len, batch))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
        new = max(workload.output_lens[start : start + batch_size])
        with torch.no_grad():
            hf.generate(
                ids.to(hf.device),
                attention_mask=mask.to(hf.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
    _sync()
    return time.perf_counter() - started


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _warm_up(llm: LLM, workload: Workload) -> None:
    """A short run on other prompts (so the prefix cache learns nothing of the workload)."""
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(-1)
    prompts = [[rng.randrange(vocab) for _ in p] for p in workload.prompts[:2]]
    run_engine(llm, Workload(prompts, [min(8, n) for n in workload.output_lens[:2]]))


def _progress(message: str) -> None:
    """Stage lines on stderr, so a run cut short by a time limit shows where it was."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = EngineArgs.from_cli_args(args)
    _progress("loading the engine")
    llm = LLM.from_engine_args(engine_args)
    workload = make_workload(args, llm.llm_engine.model_config.vocab_size)
    _progress(f"warm-up; then {len(workload.prompts)} requests, {workload.output_tokens} tokens")
    _warm_up(llm, workload)
    _progress("timing attnserve")
    seconds = run_engine(llm, workload)
    result: dict[str, Any] = {
        "model": llm.llm_engine.model_config.model,
        "device": str(llm.llm_engine.runner.device),
        "backend": llm.llm_engine.runner.backend.get_name(),
        "requests": len(workload.prompts),
        "output_tokens": workload.output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": workload.output_tokens / seconds,
        "prefix_cache_hit_rate": llm.llm_engine.allocator.prefix_hit_rate,
    }
    if args.shared_prefix:
        del llm
        _progress("timing attnserve with prefix caching off")
        no_cache = LLM.from_engine_args(replace(engine_args, enable_prefix_caching=False))
        _warm_up(no_cache, workload)
        off = run_engine(no_cache, workload)
        result["no_prefix_cache_tokens_per_s"] = workload.output_tokens / off
        result["prefix_cache_speedup"] = off / seconds
        llm = no_cache
    if args.hf_baseline:
        hf_workload = Workload(
            workload.prompts[: args.hf_num_prompts], workload.output_lens[: args.hf_num_prompts]
        )
        _progress(f"timing HF transformers on {len(hf_workload.prompts)} requests")
        hf_seconds = run_hf(llm, hf_workload, args.hf_batch_size)
        result["hf_output_tokens_per_s"] = hf_workload.output_tokens / hf_seconds
        result["ratio_to_hf"] = result["output_tokens_per_s"] / result["hf_output_tokens_per_s"]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=None, help="fixed; else random")
    parser.add_argument("--output-len", type=int, default=None, help="fixed; else random")
    parser.add_argument("--min-len", type=int, default=100, help="random lengths from here")
    parser.add_argument("--max-len", type=int, default=1024, help="random lengths up to here")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    parser.add_argument("--hf-baseline", action="store_true", help="also time HF generate")
    parser.add_argument("--hf-num-prompts", type=int, default=None, help="HF's share of prompts")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    result = benchmark(args)
    width = max(map(len, result))
    for key, value in result.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                result | {"args": {k: v for k, v in vars(args).items() if k != "handler"}},
                handle,
                indent=2,
                default=str,
            )
    return 0
