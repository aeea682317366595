"""Where a steady-state engine step's host time goes, method by method: a developer's profiler
of the engine's own internals (`attnserve bench throughput --profile-steps` is the user-facing
breakdown by kind of work: attention, matmuls, sampling, other, host).

Fills the engine with --num-seqs random prompts (lengths uniform in --min-len..--max-len),
steps until every one is prefilled, then times --steps decode-only steps with each phase's
method wrapped to add up its time. "host" is a step's time minus the model's forward and logits
(on the CPU those are the model's compute; on a GPU every launch is asynchronous and "wait for
tokens" is where the host waits for the device). With CUDA graphs on, decode steps run as graph
replays ("graph run"), and the replay of the largest graph alone is timed at the end.
--profile adds a cProfile of the same steps, sorted by own time.

    PYTHONPATH=src python tools/step_profile.py                     # llama-tiny on the CPU
    PYTHONPATH=src python tools/step_profile.py --model qwen3-0.6b --device cuda
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import time
from collections.abc import Callable
from typing import Any

import torch

import attnserve.engine.engine_core as engine_core
import attnserve.worker.model_runner as model_runner
from attnserve import LLM, SamplingParams
from attnserve.engine.llm_engine import LLMEngine
from attnserve.worker.step_future import StepFuture

Timings = collections.defaultdict[str, float]


def wrap(owner: Any, name: str, key: str, timings: Timings) -> None:
    """Replace `owner.name` with a version that adds its run time to `timings[key]`."""
    func: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = func(*args, **kwargs)
        timings[key] += time.perf_counter() - start
        return result

    setattr(owner, name, timed)


def instrument(engine: LLMEngine, timings: Timings) -> None:
    runner = engine.executor.driver_runner
    scheduler = engine.engine_core.scheduler
    wrap(scheduler, "schedule", "schedule", timings)
    wrap(scheduler, "advance", "advance", timings)
    wrap(scheduler, "resolve", "resolve", timings)
    wrap(engine_core, "build_batch", "build_batch", timings)
    wrap(runner, "execute_async", "execute", timings)
    wrap(runner, "_forward", "forward", timings)
    wrap(runner, "_layout", "layout", timings)
    wrap(model_runner, "build_metadata", "build_metadata", timings)
    wrap(runner.model, "forward", "model", timings)
    wrap(runner.model, "compute_logits", "logits", timings)
    wrap(runner.sampler, "draw", "sampler", timings)
    wrap(StepFuture, "result", "wait for tokens", timings)
    if runner.graphs is not None:
        wrap(runner.graphs, "run", "graph run", timings)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fill(engine: LLMEngine, args: argparse.Namespace) -> None:
    """Add the prompts and step until each has its first token."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for index in range(args.num_seqs):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
        engine.add_request(f"r{index}", prompt, params)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()


def time_replay(engine: LLMEngine) -> None:
    graphs = engine.executor.driver_runner.graphs
    if graphs is None:
        return
    graph, _ = graphs.graphs[graphs.max_num_seqs]
    sync()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    sync()
    per_replay = (time.perf_counter() - start) / 10 * 1e3
    print(f"  replay of the {graphs.max_num_seqs}-sequence graph alone: {per_replay:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help="a dummy preset (random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40, help="decode-only steps to time")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.num_seqs,
    )
    engine = llm.llm_engine
    fill(engine, args)
    timings: Timings = collections.defaultdict(float)
    instrument(engine, timings)
    profiler = cProfile.Profile() if args.profile else None
    sync()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(args.steps):
        engine.step()
    if profiler is not None:
        profiler.disable()
    sync()
    timings["step"] = time.perf_counter() - start
    timings["host"] = timings["step"] - timings["model"] - timings["logits"]
    running = len(engine.engine_core.scheduler.running)
    print(f"{running} running, {args.steps} decode steps, ms per step:")
    for key, total in timings.items():
        print(f"  {key:16s} {total / args.steps * 1e3:9.3f}")
    time_replay(engine)
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    llm.shutdown()


if __name__ == "__main__":
    main()
