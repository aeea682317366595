"""Where a steady-state engine step's host time goes, method by method: a developer's profiler
of the engine's own internals (`attnserve bench throughput --profile-steps` is the user-facing
breakdown by kind of work: attention, matmuls, sampling, other, host).

Two kinds of step, each timed over --steps steps (dummy weights, fresh random prompts, no
prefix-cache hits):
- decode: --num-seqs sequences (prompt lengths uniform in --min-len..--max-len) are prefilled
  first; then every step decodes each of them once;
- prompt: each step takes --prompt-tokens new prompt tokens in prompts of --prompt-len tokens
  (one token drawn each, so the next call only reads the draws back).
Each phase's method is wrapped to add up its time; methods a tree lacks are skipped, so the same
script measures an older checkout (`PYTHONPATH=<old>/src python tools/step_profile.py`) for a
before/after. Only the engine's `step()` calls are timed. "host" is a step's time minus the
model's forward, its logits and the wait for the device's tokens: the engine's own work around
the model (scheduling, the step plan, inputs, metadata, sampling bookkeeping, outputs); "host
(median)" is the median step's. On the CPU the forward and logits are the model's
compute; on a GPU every launch is asynchronous and "wait for tokens" is where the host waits for
the device. With CUDA graphs on, decode steps run as graph replays ("graph run").
--stub-model swaps the forward and logits for zeros of their shapes, so a CPU before/after of
the host work is not lost in the noise the compute leaves (caches, allocator).
--profile adds a cProfile of the timed steps, sorted by own time (`--profile-sort cumulative`:
by time within), the top 30 or the functions matching `--profile-filter REGEX`.

    PYTHONPATH=src python tools/step_profile.py                     # llama-tiny on the CPU
    PYTHONPATH=src python tools/step_profile.py --kind prompt --prompt-tokens 8192
    PYTHONPATH=src python tools/step_profile.py --model qwen3-0.6b --device cuda
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import importlib
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from attnserve import LLM, SamplingParams
from attnserve.engine.llm_engine import LLMEngine

Timings = collections.defaultdict[str, float]
HOST_PER_STEP: list[float] = []  # each timed step's (or prompt round's) host time

# (what the key times, the object path from the engine, the method); missing ones are skipped
WRAPPED = [
    ("schedule", "engine_core.scheduler", "schedule"),
    ("plan", "engine_core.pipeline.planner", "plan"),
    ("execute", "executor.driver_runner", "execute_async"),
    ("apply plan", "executor.driver_runner.input_batch", "apply"),
    ("inputs", "executor.driver_runner.input_batch", "prepare"),
    ("layout", "executor.driver_runner", "_layout"),
    ("forward", "executor.driver_runner", "_forward"),
    ("model", "executor.driver_runner.model", "forward"),
    ("logits", "executor.driver_runner.model", "compute_logits"),
    ("sampler", "executor.driver_runner.sampler", "draw"),
    ("graph run", "executor.driver_runner.graphs", "run"),
]
# (key, module, attribute path, method): module-level functions and classes (older trees too)
WRAPPED_GLOBALS = [
    ("build_batch", "attnserve.engine.engine_core", "", "build_batch"),
    ("build_metadata", "attnserve.worker.model_runner", "", "build_metadata"),
    ("wait for tokens", "attnserve.worker.step_future", "StepFuture", "result"),
]


def wrap(owner: Any, name: str, key: str, timings: Timings) -> None:
    """Replace `owner.name` with a version that adds its run time to `timings[key]`."""
    func: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = func(*args, **kwargs)
        timings[key] += time.perf_counter() - start
        return result

    setattr(owner, name, timed)


def _resolve(root: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def time_collections(timings: Timings) -> None:
    """Add the time of every garbage collection to `timings["gc"]` (a collection runs inside
    whichever method allocated when it was due, and is counted there too)."""
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            timings["gc"] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)


def instrument(engine: LLMEngine, timings: Timings) -> None:
    time_collections(timings)
    for key, path, method in WRAPPED:
        owner = _resolve(engine, path)
        if owner is not None and hasattr(owner, method):
            wrap(owner, method, key, timings)
    for key, module, path, method in WRAPPED_GLOBALS:
        try:
            owner = _resolve(importlib.import_module(module), path)
        except ModuleNotFoundError:  # a tree without it
            continue
        if owner is not None and hasattr(owner, method):
            wrap(owner, method, key, timings)


def stub_model(engine: LLMEngine) -> None:
    """Replace the model's forward and logits with views of zero buffers made once: what is
    left of a step is the engine's own host work alone, undisturbed by the compute and by
    fresh allocations of its outputs (for a steady CPU before/after; nothing real is
    generated)."""
    runner = engine.executor.driver_runner
    config, device = engine.model_config, runner.device
    rows = engine.config.scheduler_config.max_num_batched_tokens
    hidden_states = torch.zeros(rows, config.hidden_size, dtype=config.dtype, device=device)
    logits = torch.zeros(rows, config.vocab_size, dtype=torch.float32, device=device)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return hidden_states[: len(input_ids)]

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return logits[: len(hidden)]

    runner.model.forward = forward
    runner.model.compute_logits = compute_logits


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def fill(engine: LLMEngine, args: argparse.Namespace, rng: random.Random) -> None:
    """Add the decode kind's prompts and step until each has its first token."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for index in range(args.num_seqs):
        length = rng.randint(args.min_len, args.max_len)
        engine.add_request(f"r{index}", _prompt(rng, vocab, length), params)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()


DEVICE_KEYS = ("model", "logits", "wait for tokens")


def timed_step(engine: LLMEngine, timings: Timings) -> None:
    """One `step()`, its time added to "step" and its host time (see the module docstring) to
    "host"; each step's host time is kept too, for the median."""
    device_before = sum(timings[key] for key in DEVICE_KEYS)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    timings["step"] += elapsed
    timings["host"] += elapsed - (sum(timings[key] for key in DEVICE_KEYS) - device_before)


def run_decode_steps(engine: LLMEngine, args: argparse.Namespace, timings: Timings) -> None:
    for _ in range(args.steps):
        host = timings["host"]
        timed_step(engine, timings)
        HOST_PER_STEP.append(timings["host"] - host)


def make_prompts(
    engine: LLMEngine, args: argparse.Namespace, rng: random.Random
) -> list[list[list[int]]]:
    """Each round's prompts for the prompt kind (made before any timing or profiling)."""
    vocab, per_round = engine.model_config.vocab_size, args.prompt_tokens // args.prompt_len
    return [
        [_prompt(rng, vocab, args.prompt_len) for _ in range(per_round)] for _ in range(args.steps)
    ]


def run_prompt_steps(engine: LLMEngine, rounds: list[list[list[int]]], timings: Timings) -> None:
    """Each round: one step of its fresh prompts (added outside the timing), then the call
    that reads their draws back."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for round_index, prompts in enumerate(rounds):
        for index, prompt in enumerate(prompts):
            engine.add_request(f"p{round_index}-{index}", prompt, params)
        host = timings["host"]
        while engine.has_unfinished_requests():
            timed_step(engine, timings)
        HOST_PER_STEP.append(timings["host"] - host)


def _llm(args: argparse.Namespace) -> LLM:
    prompt = args.kind == "prompt"
    return LLM(
        args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.prompt_tokens if prompt else None,
        max_model_len=max(args.prompt_len, args.max_len) + args.steps + 8,
        enable_prefix_caching=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("decode", "prompt"), default="decode")
    parser.add_argument("--model", default="llama-tiny", help="a dummy preset (random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="per prompt step")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="steps to time")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    parser.add_argument(
        "--profile-sort", default="tottime", choices=("tottime", "cumulative"),
        help="order of the profile's functions",
    )  # fmt: skip
    parser.add_argument(
        "--profile-filter", default=None, metavar="REGEX",
        help="print only the profile's functions whose file:line(name) matches (default: top 30)",
    )  # fmt: skip
    parser.add_argument(
        "--stub-model", action="store_true",
        help="zeros for the model's forward and logits: time the engine's host work alone",
    )  # fmt: skip
    args = parser.parse_args()
    llm = _llm(args)
    engine = llm.llm_engine
    if args.stub_model:
        stub_model(engine)
    rng = random.Random(0)
    run: Callable[[Timings], None] = functools.partial(run_decode_steps, engine, args)
    if args.kind == "decode":
        fill(engine, args, rng)
    else:
        warm_up = argparse.Namespace(**{**vars(args), "steps": 2})
        warm_up_rounds = make_prompts(engine, warm_up, rng)
        run_prompt_steps(engine, warm_up_rounds, collections.defaultdict(float))
        HOST_PER_STEP.clear()
        run = functools.partial(run_prompt_steps, engine, make_prompts(engine, args, rng))
    timings: Timings = collections.defaultdict(float)
    instrument(engine, timings)
    profiler = cProfile.Profile() if args.profile else None
    sync()
    if profiler is not None:
        profiler.enable()
    run(timings)
    if profiler is not None:
        profiler.disable()
    what = f"{args.num_seqs} sequences" if args.kind == "decode" else f"{args.prompt_tokens} tokens"
    print(f"{args.kind} steps of {what}, {args.steps} timed, ms per step:")
    for key, total in timings.items():
        print(f"  {key:16s} {total / args.steps * 1e3:9.3f}")
    print(f"  {'host (median)':16s} {statistics.median(HOST_PER_STEP) * 1e3:9.3f}")
    print(f"  {'host (min)':16s} {min(HOST_PER_STEP) * 1e3:9.3f}")
    if profiler is not None:
        restriction = args.profile_filter if args.profile_filter is not None else 30
        pstats.Stats(profiler).sort_stats(args.profile_sort).print_stats(restriction)
    llm.shutdown()


if __name__ == "__main__":
    main()
