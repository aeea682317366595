"""`attnserve bench throughput`: offline generation throughput, its bound and where the time
goes, with baselines measured in the same run.

Workloads: N requests of random token ids with fixed input/output lengths, or lengths uniform in
[min, max] (nano-vllm's offline benchmark: 256 requests, 100..1024, seed 0), or a named kind
(`--workload`: standard, chat, long, prefix, short; bench/workloads.py), `ignore_eos`, all
submitted at once, after one warm-up. Also reported: the KV cache's size in tokens, the output
tokens per engine step of the timed run (about the sequences a step runs: the cache's hold under
KV pressure) and its preemptions; the workload's bound from the model's shape at the copy
bandwidth and matmul rate measured first in the same run (bench/bound.py) and the fraction of it
reached; the step-time breakdown of `--profile-steps` profiled decode steps and, with
`--profile-run N`, of the whole workload run again with one step in N profiled (prompt-bearing
steps in proportion; bench/breakdown.py), each on an engine rebuilt with `enforce_eager`, since
CUDA and CPU graphs hide kernels (for `--profile-run` also when already eager: a fresh engine's
prefix cache holds none of the workload, as at the timed run's start).
Optional: HF transformers `generate` on the same weights (static batches) and, with it, on the
CPU with a GGUF model where llama_cpp is installed, llama.cpp batched on the same workload
(bench/llamacpp_batch.py); with `--shared-prefix`, the same engine with prefix caching off;
`--batch-sizes 16,64,256`, the workload again with that many requests (fresh prompts, same
length distribution, each point against its own bound); `--plot FILE.png`, the breakdown and the
sweep; `--json-schema FILE`, the workload again with that JSON schema on every request
(structured outputs: each request also ends where its grammar does, so its rate counts the
tokens it made) and its cost against the unconstrained rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import replace
from typing import Any

import torch

from attnserve.bench.bound import ModelShape, Rates, measure_rates, workload_bound
from attnserve.bench.breakdown import Breakdown, format_breakdown, profile_engine, profile_run
from attnserve.bench.common import (
    Workload,
    check_output_files,
    positive_ints,
    progress,
    report,
    run_engine,
    spec_decode_figures,
    sync,
    timed_generate,
)
from attnserve.bench.llamacpp_batch import llama_cpp_batched_figures
from attnserve.bench.lora import add_lora_arguments, with_random_loras
from attnserve.bench.plot import plot_throughput, require_matplotlib
from attnserve.bench.workloads import KINDS, draw_workload, uniform_workload
from attnserve.config import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.output_constraints import StructuredOutputsParams

BOUND_RULE = "all requests at once; a step takes max(bytes / copy rate, FLOPs / matmul rate)"


def make_workload(
    args: argparse.Namespace, vocab_size: int, num_prompts: int | None = None, seed: int = 0
) -> Workload:
    """The `--workload` kind, or random prompts (a shared prefix first, when asked) and output
    lengths from the length flags, seeded by `args.seed` + `seed`."""
    if getattr(args, "workload", None) is not None and num_prompts is None:
        return draw_workload(args.workload, vocab_size)
    return uniform_workload(
        num_prompts or args.num_prompts,
        (args.min_len, args.max_len),
        vocab_size,
        prefix=args.shared_prefix,
        seed=args.seed + seed,
        fixed=(args.input_len, args.output_len),
    )


def run_hf(llm: LLM, workload: Workload, batch_size: int) -> float:
    """Seconds for HF `generate` over the workload in static, left-padded batches."""
    from attnserve.model.models.hf_export import to_hf_model

    engine = llm.llm_engine
    hf = to_hf_model(engine.executor.driver_runner.model, engine.model_config)
    hf.generation_config.eos_token_id = None
    sync()
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
    sync()
    return time.perf_counter() - started


def _warm_up(llm: LLM, workload: Workload) -> None:
    """A short run on other prompts (so the prefix cache learns nothing of the workload), one
    for each LoRA adapter the workload uses (so each is read from disk before the timing)."""
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(-1)
    loras = workload.lora_requests
    count = max(2, len(set(loras or [])))
    prompts = [[rng.randrange(vocab) for _ in p] for p in workload.prompts[:count]]
    lens = [min(8, n) for n in workload.output_lens[:count]]
    run_engine(llm, Workload(prompts, lens, None if loras is None else loras[:count]))


def _against_bound(
    seconds: float, workload: Workload, shape: ModelShape, rates: Rates
) -> dict[str, float]:
    bound = workload_bound(shape, workload.input_lens, workload.output_lens, rates)
    measured = workload.output_tokens / seconds
    return {
        "output_tokens_per_s": measured,
        "bound_tokens_per_s": bound.tokens_per_s,
        "fraction_of_bound": measured / bound.tokens_per_s,
        "bound_memory_bound_step_share": bound.memory_bound_steps / max(bound.decode_steps, 1),
    }


def _sweep(
    llm: LLM, args: argparse.Namespace, shape: ModelShape, rates: Rates
) -> list[dict[str, float]]:
    """The workload with each of `args.batch_sizes` requests (fresh prompts), vs its bound."""
    vocab = llm.llm_engine.model_config.vocab_size
    rows = []
    for size in args.batch_sizes:
        workload = make_workload(args, vocab, num_prompts=size, seed=size)
        progress(f"sweep: {size} requests, {workload.output_tokens} tokens")
        figures = _against_bound(run_engine(llm, workload), workload, shape, rates)
        rows.append({"batch_size": size} | figures)
    return rows


def _cache_facts(llm: LLM, block_size: int) -> dict[str, Any]:
    """The attention backend and the KV cache's size in tokens (where every KV-cache group
    holds a block per `block_size` tokens: a model whose window layers free blocks holds more),
    and its groups. No reference to the runner outlives this call: a benchmark that drops the
    engine to build another must free its cache."""
    runner = llm.llm_engine.executor.driver_runner
    groups = len(runner.kv_cache_windows)
    return {
        "backend": runner.backend.get_name(),
        "kv_cache_tokens": runner.num_blocks // groups * block_size,
        "kv_cache_groups": groups,
    }


def _eager_engine(engine_args: EngineArgs, workload: Workload) -> LLM:
    """A warmed-up engine without CUDA or CPU graphs (they hide kernels from the profiler)."""
    progress("rebuilding the engine with enforce_eager for the profile")
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM.from_engine_args(replace(engine_args, enforce_eager=True))
    _warm_up(llm, workload)
    return llm


def _no_prefix_cache(
    engine_args: EngineArgs, workload: Workload, seconds: float
) -> tuple[LLM, dict[str, float]]:
    """The workload timed with prefix caching off: that engine, and the comparison."""
    progress("timing attnserve with prefix caching off")
    llm = LLM.from_engine_args(replace(engine_args, enable_prefix_caching=False))
    _warm_up(llm, workload)
    off = run_engine(llm, workload)
    return llm, {
        "no_prefix_cache_tokens_per_s": workload.output_tokens / off,
        "prefix_cache_speedup": off / seconds,
    }


def _hf_figures(llm: LLM, args: argparse.Namespace, workload: Workload) -> dict[str, float]:
    count = args.hf_num_prompts
    hf_workload = Workload(workload.prompts[:count], workload.output_lens[:count])
    progress(f"timing HF transformers on {len(hf_workload.prompts)} requests")
    hf_seconds = run_hf(llm, hf_workload, args.hf_batch_size)
    return {"hf_output_tokens_per_s": hf_workload.output_tokens / hf_seconds}


def _json_schema(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The --json-schema file's schema as a constraint; ValueError if it is not one."""
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema) as handle:
            schema = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--json-schema {args.json_schema!r}: {error}") from error
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {args.json_schema!r}: not a JSON schema object")
    return StructuredOutputsParams(json=schema)


def _structured_figures(
    llm: LLM, workload: Workload, spec: StructuredOutputsParams, tokens_per_s: float
) -> dict[str, float]:
    """The workload with the schema on every request (compiled already, in a warm-up)."""
    progress("timing attnserve with the JSON schema on every request")
    seconds, tokens = timed_generate(llm, workload, spec)
    constrained = tokens / seconds
    return {
        "json_schema_output_tokens": tokens,
        "json_schema_tokens_per_s": constrained,
        "json_schema_cost": 1 - constrained / tokens_per_s,
    }


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not 1 <= args.min_len <= args.max_len:
        raise ValueError(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
    if args.workload is not None and args.batch_sizes:
        raise ValueError("--batch-sizes sweeps the length flags' workload, not a --workload kind")
    if args.profile_steps < 0:
        raise ValueError(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.profile_run < 0:
        raise ValueError(f"--profile-run must be >= 0 (0: off), got {args.profile_run}")
    if args.plot and not (args.profile_steps or args.batch_sizes):
        raise ValueError(
            "--plot draws the breakdown or the sweep: use --profile-steps or --batch-sizes"
        )
    check_output_files(args, "json", "plot")


def _profiles(llm: LLM, workload: Workload, args: argparse.Namespace) -> dict[str, Breakdown]:
    """The breakdowns asked for, by their result key, on an eager engine: the sampled whole run
    first (while the prefix cache holds none of the workload), then the decode steps."""
    breakdowns = {}
    if args.profile_run:
        progress(f"profiling one step in {args.profile_run} of the workload run again")
        breakdowns["run_breakdown"] = profile_run(llm.llm_engine, workload, args.profile_run)
    if args.profile_steps:
        progress(f"profiling {args.profile_steps} decode steps")
        breakdowns["breakdown"] = profile_engine(llm.llm_engine, workload, args.profile_steps)
    return breakdowns


def benchmark(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Breakdown]]:
    """The figures (see the module docstring) and the breakdowns profiled, by result key."""
    _check(args)
    structured = _json_schema(args)
    engine_args = EngineArgs.from_cli_args(args).with_offline_defaults()
    config = engine_args.create_engine_config()
    model_config, device = config.model_config, config.device
    max_num_seqs = config.scheduler_config.max_num_seqs
    too_many = [b for b in args.batch_sizes if b > max_num_seqs]
    if too_many:
        raise ValueError(f"--batch-sizes {too_many} exceed --max-num-seqs {max_num_seqs}")
    progress(f"measuring copy bandwidth and {model_config.dtype} matmul rate on {device}")
    rates = measure_rates(device, model_config.dtype)
    shape = ModelShape.from_config(model_config, engine_args.kv_cache_dtype)
    progress("loading the engine")
    llm = LLM.from_engine_args(engine_args)
    workload = with_random_loras(make_workload(args, model_config.vocab_size), args, model_config)
    if structured is not None:  # a bad schema fails now, not after the first timing
        timed_generate(llm, Workload(workload.prompts[:2], [4, 4]), structured)
    progress(f"warm-up; then {len(workload.prompts)} requests, {workload.output_tokens} tokens")
    _warm_up(llm, workload)
    progress("timing attnserve")
    before = llm.llm_engine.stats()
    seconds = run_engine(llm, workload)
    after = llm.llm_engine.stats()
    progress(f"attnserve: {workload.output_tokens / seconds:,.0f} output tok/s ({seconds:.2f} s)")
    steps = after["num_steps"] - before["num_steps"]
    result: dict[str, Any] = {
        "model": model_config.model,
        "device": str(device),
        **_cache_facts(llm, config.cache_config.block_size),
        "kv_cache_dtype": engine_args.kv_cache_dtype,
        "requests": len(workload.prompts),
        "output_tokens": workload.output_tokens,
        "seconds": seconds,
        # how many sequences a step runs on average, and how often the cache ran out
        "output_tokens_per_step": workload.output_tokens / max(steps, 1),
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        **spec_decode_figures(before, after),
        **({"num_loras": args.num_loras, "lora_rank": args.lora_rank} if args.num_loras else {}),
    }
    result |= _against_bound(seconds, workload, shape, rates)
    result |= {"bound_rule": BOUND_RULE, **rates.figures()}
    result["prefix_cache_hit_rate"] = llm.llm_engine.stats()["prefix_cache_hit_rate"]
    if structured is not None:
        result |= _structured_figures(llm, workload, structured, result["output_tokens_per_s"])
    if args.batch_sizes:
        result["sweep"] = _sweep(llm, args, shape, rates)
    if args.shared_prefix:
        del llm
        llm, figures = _no_prefix_cache(engine_args, workload, seconds)
        result |= figures
    if args.hf_baseline:
        result |= _hf_figures(llm, args, workload)
        result["ratio_to_hf"] = result["output_tokens_per_s"] / result["hf_output_tokens_per_s"]
        result |= llama_cpp_batched_figures(
            args.model, device, workload, result["output_tokens_per_s"]
        )
    if not (args.profile_steps or args.profile_run):
        return result, {}
    if args.profile_run or not engine_args.enforce_eager:
        del llm
        llm = _eager_engine(engine_args, workload)
    breakdowns = _profiles(llm, workload, args)
    return result | {key: b.as_dict() for key, b in breakdowns.items()}, breakdowns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, default=16, help="requests to run")
    parser.add_argument("--input-len", type=int, default=None, help="fixed; else random")
    parser.add_argument("--output-len", type=int, default=None, help="fixed; else random")
    parser.add_argument("--min-len", type=int, default=100, help="random lengths from here")
    parser.add_argument("--max-len", type=int, default=1024, help="random lengths up to here")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt shares")
    parser.add_argument(
        "--workload",
        choices=list(KINDS),
        default=None,
        help="a named workload kind (bench/workloads.py) in place of --num-prompts, the "
        "length flags and --shared-prefix",
    )
    parser.add_argument(
        "--hf-baseline", action="store_true", help="also time HF generate (and llama.cpp)"
    )
    parser.add_argument("--hf-num-prompts", type=int, default=None, help="HF's share of prompts")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HF batch size")
    parser.add_argument(
        "--profile-steps", type=int, default=8, help="decode steps to profile; 0: no breakdown"
    )
    parser.add_argument(
        "--profile-run", type=int, default=0, metavar="EVERY",
        help="also run the workload again, profiling one step in EVERY; 0 (default): off",
    )  # fmt: skip
    parser.add_argument(
        "--batch-sizes", type=positive_ints, default=[], metavar="B1,B2,...",
        help="also run the workload with each many requests, against its bound",
    )  # fmt: skip
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures")
    parser.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="also time the workload with this JSON schema on every request",
    )
    parser.add_argument("--json", default=None, help="also write the figures here")
    add_lora_arguments(parser)
    parser.set_defaults(handler=main)


def _print_sweep(rows: list[dict[str, float]]) -> None:
    print(f"{'requests':>8} {'tokens/s':>12} {'bound':>12} {'fraction':>8}")
    for row in rows:
        print(
            f"{row['batch_size']:>8} {row['output_tokens_per_s']:>12,.1f} "
            f"{row['bound_tokens_per_s']:>12,.1f} {row['fraction_of_bound']:>8.1%}"
        )


def main(args: argparse.Namespace) -> int:
    if args.plot:
        require_matplotlib()  # fail before the run, not after it
    result, breakdowns = benchmark(args)
    report(result, args)
    for breakdown in breakdowns.values():
        print(format_breakdown(breakdown))
    if result.get("sweep"):
        _print_sweep(result["sweep"])
    if args.plot:
        title = f"{result['model']} on {result['device']} ({result['backend']})"
        plot_throughput(args.plot, title, breakdowns.get("breakdown"), result.get("sweep", []))
    return 0
