"""Host-side cost of one engine step at 256 sequences, per phase, on a tiny dummy CPU model.

Each phase is timed by wrapping the method that does it; steps are split into those with a
prefill and decode-only ones (the steady state). "host" is a step's time minus the model's own
compute (its forward and logits), i.e. what the host would add to a GPU step. The decode-only
padding of a CUDA-graph step (`pad_decode_step`) is timed on its own at the end, since the CPU
run never takes that path.

    PYTHONPATH=src:. OMP_NUM_THREADS=1 python scripts/host_overhead.py [--profile] [--steps N]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import attnserve.engine.llm_engine as le
from attnserve import LLM, SamplingParams
from attnserve.attention.backends.layout import build_step_layout, pad_decode_step
from attnserve.core import is_prefill
from attnserve.sampling_params import RequestOutputKind
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


def instrument(llm: LLM, timings: Timings) -> None:
    eng = llm.llm_engine
    runner = eng.executor.driver_runner
    wrap(eng.scheduler, "schedule", "schedule", timings)
    wrap(eng.scheduler, "advance", "advance", timings)
    wrap(eng.scheduler, "resolve", "resolve", timings)
    wrap(le, "build_batch", "build_batch", timings)
    wrap(runner, "execute_async", "execute", timings)
    wrap(runner, "_forward", "forward", timings)
    wrap(runner, "_prepare_inputs", "prepare_inputs", timings)
    wrap(runner.builder, "build", "builder.build", timings)
    wrap(runner.sampler, "draw", "sampler", timings)
    wrap(StepFuture, "result", "wait for tokens", timings)
    wrap(runner.model, "forward", "model (device)", timings)
    wrap(runner.model, "compute_logits", "logits (device)", timings)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, profile: bool) -> None:
    eng = llm.llm_engine
    steps: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": []}
    timings: Timings = collections.defaultdict(float)
    instrument(llm, timings)
    for n, prompt in enumerate(prompts):
        eng.add_request(f"r{n}", prompt, params)
    profiler = cProfile.Profile() if profile else None
    while eng.has_unfinished_requests():
        timings.clear()
        decode_only = not eng.scheduler.waiting and not any(
            is_prefill(len(s.token_ids) - s.num_computed_tokens, s.num_computed_tokens)
            for s in eng.scheduler.running
        )
        if profiler is not None and decode_only:
            profiler.enable()
        start = time.perf_counter()
        eng.step()
        timings["step"] += time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        timings["host"] = timings["step"] - timings["model (device)"] - timings["logits (device)"]
        timings["execute - rest"] = timings["execute"] - sum(
            timings[key] for key in ("forward", "logits (device)", "sampler")
        )
        timings["step - rest"] = timings["step"] - sum(
            timings[key]
            for key in (
                "schedule",
                "build_batch",
                "execute",
                "advance",
                "resolve",
                "wait for tokens",
            )
        )
        steps["decode" if decode_only else "prefill"].append(dict(timings))
    for kind, rows in steps.items():
        print(f"--- {kind}: {len(rows)} steps, ms/step (mean, median)")
        for key in rows[0] if rows else []:
            values = [row.get(key, 0.0) * 1000 for row in rows]
            print(f"  {key:16s} {statistics.mean(values):8.2f} {statistics.median(values):8.2f}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def time_layouts(num_seqs: int, rng: random.Random, repeats: int = 50) -> None:
    """Per-call cost of the shared layout helpers for a decode-only step of `num_seqs`."""
    ctx = [rng.randint(100, 2048) for _ in range(num_seqs)]
    tables = [list(range(i * 200, i * 200 + c // 16 + 1)) for i, c in enumerate(ctx)]
    ones = [1] * num_seqs
    for name, call in (
        ("build_step_layout", lambda: build_step_layout(tables, ctx, ones, 16)),
        ("pad_decode_step", lambda: pad_decode_step(tables, ctx, num_seqs, 16)),
    ):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        print(f"  {name:18s} {(time.perf_counter() - start) / repeats * 1000:8.2f} ms/call")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64, help="output tokens per request")
    parser.add_argument("--profile", action="store_true", help="cProfile the decode-only steps")
    args = parser.parse_args()
    llm = LLM(model="llama-tiny", load_format="dummy", device="cpu", dtype="float32")
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(100, 300))] for _ in range(args.num_seqs)
    ]
    params = SamplingParams(
        temperature=0,
        max_tokens=args.steps,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,  # as `LLM.generate` asks
    )
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    run(llm, prompts, params, args.profile)
    print(f"--- layout helpers, {args.num_seqs} decodes")
    time_layouts(args.num_seqs, rng)


if __name__ == "__main__":
    main()
