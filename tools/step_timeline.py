"""Where an offline run's wall time goes, step by step: a diagnostic for the GPU machine.

    PYTHONPATH=src python3 tools/step_timeline.py PRESET [ENGINE_ARG=VALUE ...]

Runs the standard offline workload (256 requests, 100..1024 tokens in and out, seed 0, as
`attnserve bench throughput` draws it) through `LLM.generate` with the engine core in this
process, and timestamps every step launch. Launch-to-launch time is the step period (with async
scheduling the host runs one step ahead, so it is the device's pace when the device is the
limit). Prints the run's total, the time in steps that carry prompt tokens, and the decode-only
steps grouped by batch size (mean period per group, tokens per second within it).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any

from attnserve import LLM, SamplingParams
from attnserve.bench.throughput import make_workload


def _engine_kwargs(pairs: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        kwargs[key] = int(value) if value.isdigit() else value
    return kwargs


def main() -> None:
    preset, *pairs = sys.argv[1:]
    llm = LLM(preset, load_format="dummy", dtype="bfloat16", seed=0, **_engine_kwargs(pairs))
    core = llm.llm_engine.engine_core
    events: list[tuple[float, int, int]] = []  # launch time, prompt tokens, sequences
    launch = core._launch

    def timed_launch(scheduled: Any) -> Any:
        prompt = sum(i.num_new_tokens for i in scheduled.scheduled if i.is_prefill)
        events.append((time.perf_counter(), prompt, len(scheduled.scheduled)))
        return launch(scheduled)

    core._launch = timed_launch  # type: ignore[method-assign]
    ns = argparse.Namespace(
        seed=0,
        min_len=100,
        max_len=1024,
        input_len=None,
        output_len=None,
        shared_prefix=0,
        num_prompts=256,
    )
    work = make_workload(ns, llm.llm_engine.model_config.hf_config.vocab_size)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    llm.generate(work.prompts[:2], params[:2], use_tqdm=False)
    events.clear()
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    _report(events, start, total, made)


def _report(events: list[tuple[float, int, int]], start: float, total: float, made: int) -> None:
    ends = [t for t, _, _ in events[1:]] + [start + total]
    prompt_s, groups = 0.0, defaultdict(lambda: [0.0, 0, 0])
    for (t, prompt, seqs), end in zip(events, ends, strict=True):
        if prompt:
            prompt_s += end - t
        else:
            group = groups[(seqs - 1) // 32]
            group[0] += end - t
            group[1] += 1
            group[2] += seqs
    print(
        f"total {total:.2f} s, {made / total:,.0f} tok/s, {len(events)} steps, "
        f"first launch after {events[0][0] - start:.3f} s"
    )
    print(f"steps with prompt tokens: {sum(1 for e in events if e[1])}, {prompt_s:.2f} s")
    for key in sorted(groups):
        seconds, steps, tokens = groups[key]
        print(
            f"decode {key * 32 + 1:>3}-{key * 32 + 32:<3}: {steps:>4} steps, {seconds:.2f} s, "
            f"{seconds / steps * 1e3:.2f} ms/step, {tokens / seconds:,.0f} tok/s"
        )


if __name__ == "__main__":
    main()
