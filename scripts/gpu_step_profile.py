"""Where a decode step's time goes on the GPU machine, with CUDA graphs on.

Fills the engine with `--num-seqs` random prompts, runs them past prefill, then times
`--steps` decode-only steps: each phase of the host (wrapped methods), the wait for the GPU
(the sampler's host copy of the tokens is where the step syncs), the replay of the largest
graph alone, and a cProfile of the same steps sorted by own time.

    PYTHONPATH=src:. python3 scripts/gpu_step_profile.py --model qwen3-0.6b
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import time

import torch

import attnserve.engine.llm_engine as le
from attnserve import LLM, SamplingParams
from attnserve.worker.step_future import StepFuture
from scripts.host_overhead import wrap


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--backend", default="TRITON")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    llm = LLM(model=args.model, load_format="dummy", attention_backend=args.backend)
    engine = llm.llm_engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(args.num_seqs):
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(512)], params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    timings: collections.defaultdict[str, float] = collections.defaultdict(float)
    runner = engine.executor.driver_runner
    wrap(engine.scheduler, "schedule", "schedule", timings)
    wrap(engine.scheduler, "advance", "advance", timings)
    wrap(engine.scheduler, "resolve", "resolve", timings)
    wrap(runner, "_forward", "forward (enqueue)", timings)
    wrap(runner.model, "compute_logits", "compute_logits (enqueue)", timings)
    wrap(runner.sampler, "draw", "sampler (enqueue)", timings)
    wrap(StepFuture, "result", "wait for tokens (GPU)", timings)
    wrap(le, "build_batch", "build_batch", timings)
    profile = cProfile.Profile()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    started = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    wall = (time.perf_counter() - started) / args.steps
    print(f"{len(engine.scheduler.running)} running; {wall * 1e3:.2f} ms per decode step")
    for key, total in timings.items():
        print(f"  {key:28s} {total / args.steps * 1e3:8.3f} ms")
    graphs = runner.cuda_graphs
    if graphs is not None:
        graph, _ = graphs.graphs[graphs.max_num_seqs]
        sync()
        start = time.perf_counter()
        for _ in range(10):
            graph.replay()
        sync()
        print(
            f"  replay of the {graphs.max_num_seqs}-graph alone: "
            f"{(time.perf_counter() - start) / 10 * 1e3:.3f} ms"
        )
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
