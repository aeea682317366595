"""Where an offline run's wall time goes, step by step: a diagnostic for the GPU machine.

    PYTHONPATH=src python3 tools/step_timeline.py PRESET [--workload KIND | --workload-file F]
        [--runs N] [--profile-prompt-steps K] [--json FILE] [ENGINE_ARG=VALUE ...]

Runs a workload (a kind of `attnserve.bench.workloads`, default the standard one, or a JSON file
of `tools/sbs/workloads.py`) through `LLM.generate` with the engine core in this process, after a
2-request warm-up, `--runs` times on one engine (default 3: the first pays for what compiles on
first use, the second shows the steady state, the last also profiles K of its prompt steps; each
run after the first draws new prompts of the same lengths, so none hits the prefix cache).

For every step: the launch time, the prompt and decode tokens, the host time (scheduling,
building the batch, launching the step: everything before the device can run it), split into
phases (scheduling, the step layout, the forward launch, logits, sampling; with a draft model
also its take-in, proposals and catch-up passes, where they run), and the device time (CUDA
events around the step's work on the stream: from the end of the previous step's work to the
end of this one's, so a device waiting on the host counts). Every Triton JIT compile and every
full (or > 10 ms) garbage collection is timestamped. Launch-to-launch time is the step period.
Printed per run: the total, the steps that carry prompt tokens, the steps that verify drafts,
the other steps grouped by batch size (32 at a time), the slowest steps with their host
phases, the mean phases and their run totals, the compiles and collections; then, of K prompt
steps of the last run (every third from its second; each launched as usual, then waited for,
and left out of that run's figures), the device time by kernel (attention, matmul, the rest),
the top kernels and the host's CUDA calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from attnserve import LLM, SamplingParams
from attnserve.bench.breakdown import category, kernel_records
from attnserve.bench.common import Workload, sync
from attnserve.bench.workloads import KINDS, draw_workload

# (object path from the engine core, method): host phases of a step, timed on every call
PHASES = (
    ("executor.driver_runner", "_prepare"),
    ("executor.driver_runner", "_forward"),
    ("executor.driver_runner.model", "compute_logits"),
    ("executor.driver_runner.sampler", "draw"),
)
# the same for a draft model (speculative decoding), where the engine has one: its take-in of
# a step with its drafts, within that its proposals, within those its catch-up passes
DRAFT_PHASES = (
    ("executor.worker.proposer", "follow"),
    ("executor.worker.proposer", "_propose"),
    ("executor.worker.proposer", "_catch_up"),
)


@dataclass
class Step:
    launched_at: float
    prompt_tokens: int
    decode_tokens: int  # the decoding sequences' tokens, drafts to verify included
    verifies: bool  # some sequence verifies drafts (speculative decoding)
    host_ms: float
    phases_ms: dict[str, float]
    events: tuple[Any, Any] | None = field(default=None, repr=False)
    device_ms: float = 0.0


@dataclass
class Recorder:
    """Wraps the engine core's `schedule` and its pipeline's `launch` to time each step."""

    steps: list[Step] = field(default_factory=list)
    compiles: list[tuple[float, float, str]] = field(default_factory=list)  # at, seconds, kernel
    profile_left: int = 0
    prompt_steps_seen: int = 0
    kernels: list[Any] = field(default_factory=list)
    host_calls: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # ms
    gc_pauses: list[tuple[float, float, int]] = field(default_factory=list)  # at, s, generation
    _scheduled_s: float = 0.0
    _phases: dict[str, float] = field(default_factory=dict)
    _compile_started: dict[str, float] = field(default_factory=dict)
    _gc_started: float = 0.0

    def install(self, core: Any) -> None:
        schedule, launch = core.scheduler.schedule, core.pipeline.launch

        def timed_schedule() -> Any:
            started = time.perf_counter()
            out = schedule()
            self._scheduled_s = time.perf_counter() - started
            return out

        def timed_launch(scheduled: Any) -> Any:
            items = scheduled.scheduled
            prompt = sum(i.num_new_tokens for i in items if i.is_prefill and not i.spec_token_ids)
            decode = sum(i.num_new_tokens for i in items if not i.is_prefill or i.spec_token_ids)
            if prompt:
                self.prompt_steps_seen += 1
                if self.profile_left and self.prompt_steps_seen % 3 == 2:
                    return self._profiled(launch, scheduled)
            started = time.perf_counter()
            events = _events()
            self._phases = {"schedule": self._scheduled_s * 1e3}
            launched = launch(scheduled)
            if events is not None:
                events[1].record()
            host_ms = (self._scheduled_s + time.perf_counter() - started) * 1e3
            verifies = any(i.spec_token_ids for i in items)
            self.steps.append(
                Step(started, prompt, decode, verifies, host_ms, self._phases, events)
            )
            return launched

        core.scheduler.schedule = timed_schedule
        core.pipeline.launch = timed_launch
        for path, name in PHASES:
            self._time_phase(core, path, name)
        if getattr(getattr(core.executor, "worker", None), "proposer", None) is not None:
            for path, name in DRAFT_PHASES:
                self._time_phase(core, path, name)
        self._install_compile_hooks()
        gc.callbacks.append(self._on_gc)

    def _time_phase(self, core: Any, path: str, name: str) -> None:
        owner = core
        for attribute in path.split("."):
            owner = getattr(owner, attribute)
        method = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = (time.perf_counter() - started) * 1e3
                self._phases[name] = self._phases.get(name, 0.0) + spent

        setattr(owner, name, timed)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif info["generation"] == 2 or time.perf_counter() - self._gc_started > 0.01:
            at = self._gc_started
            self.gc_pauses.append((at, time.perf_counter() - at, info["generation"]))

    def _profiled(self, launch: Any, scheduled: Any) -> Any:
        """Launch a step under the profiler (the previous one may still run, as usual) and
        wait for it; keep its kernels and its host's CUDA calls."""
        self.profile_left -= 1
        self._phases = {}
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities[: 1 + torch.cuda.is_available()]) as prof:
            launched = launch(scheduled)
            sync()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as file:
                trace = json.load(file)
        self.kernels.append(kernel_records(trace))
        for event in trace["traceEvents"]:
            if event.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in event:
                self.host_calls[event["name"]] += float(event["dur"]) / 1e3
        return launched

    def _install_compile_hooks(self) -> None:
        try:
            from triton import knobs
        except ImportError:
            return

        def before(**kwargs: Any) -> bool:
            self._compile_started[str(kwargs.get("key"))] = time.perf_counter()
            return False

        def after(**kwargs: Any) -> None:
            now = time.perf_counter()
            started = self._compile_started.pop(str(kwargs.get("key")), now)
            name = getattr(kwargs.get("fn"), "name", str(kwargs.get("fn")))
            self.compiles.append((started, now - started, str(name)))

        knobs.runtime.jit_cache_hook = before
        knobs.runtime.jit_post_compile_hook = after

    def resolve(self) -> None:
        sync()
        for step in self.steps:
            if step.events is not None:
                step.device_ms = step.events[0].elapsed_time(step.events[1])
                step.events = None


def _events() -> tuple[Any, Any] | None:
    if not torch.cuda.is_available():
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _load_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.workload_file is None:
        return draw_workload(args.workload, vocab_size)
    with open(args.workload_file) as file:
        data = json.load(file)
    return Workload(data["prompts"], data["output_lens"])


def _engine_kwargs(pairs: list[str]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        kwargs[key] = int(value) if value.isdigit() else _json_or_text(value)
    return kwargs


def _json_or_text(value: str) -> Any:
    """A JSON object (`speculative_config={...}`) parsed, anything else as given."""
    return json.loads(value) if value.startswith("{") else value


def _fresh_prompts(work: Workload, vocab: int, seed: int) -> Workload:
    """The workload's lengths with other random prompts (a later run must not hit the prefix
    cache the earlier ones filled); seed 0: the workload itself."""
    if seed == 0:
        return work
    rng = random.Random(seed)
    return Workload([[rng.randrange(vocab) for _ in p] for p in work.prompts], work.output_lens)


def _timed_run(llm: LLM, recorder: Recorder, work: Workload) -> dict[str, Any]:
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens
    ]
    recorder.steps.clear()
    recorder.compiles.clear()
    recorder.gc_pauses.clear()
    recorder.prompt_steps_seen = 0
    start = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    recorder.resolve()
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    return _report(recorder, start, total, made)


def _report(recorder: Recorder, start: float, total: float, made: int) -> dict[str, Any]:
    steps = recorder.steps
    ends = [s.launched_at for s in steps[1:]] + [start + total]
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0])
    for step, end in zip(steps, ends, strict=True):
        if step.prompt_tokens:
            key = "prompt"
        elif step.verifies:
            key = "verify"
        else:
            key = f"decode {(step.decode_tokens - 1) // 32:02d}"
        values = (1, end - step.launched_at, step.host_ms, step.device_ms, step.prompt_tokens,
                  step.decode_tokens)  # fmt: skip
        groups[key] = [total + value for total, value in zip(groups[key], values, strict=True)]
    compile_s = sum(seconds for _, seconds, _ in recorder.compiles)
    print(
        f"total {total:.2f} s, {made / total:,.0f} output tok/s, {len(steps)} steps; "
        f"{len(recorder.compiles)} JIT compiles, {compile_s:.2f} s"
    )
    print(
        f"{'steps':<16}{'n':>6}{'wall s':>8}{'host ms':>9}{'dev ms':>9}{'prompt':>8}{'decode':>8}"
    )
    rows = {}
    for key in sorted(groups):
        n, wall, host, device, prompt, decode = groups[key]
        label = _decode_label(int(key.split()[1])) if key.startswith("decode") else key
        print(
            f"{label:<16}{n:>6}{wall:>8.2f}{host / n:>9.2f}{device / n:>9.2f}"
            f"{prompt / n:>8.0f}{decode / n:>8.0f}"
        )
        rows[label] = {
            "steps": n,
            "wall_s": wall,
            "host_ms_per_step": host / n,
            "device_ms_per_step": device / n,
            "prompt_tokens_per_step": prompt / n,
            "decode_rows_per_step": decode / n,
        }
    slowest = sorted(zip(steps, ends, strict=True), key=lambda p: p[0].launched_at - p[1])[:6]
    print(
        "slowest steps (period ms, host ms, device ms, prompt tokens, decode rows, at s; "
        "host phases ms):"
    )
    for step, end in slowest:
        phases = " ".join(f"{k}={v:.1f}" for k, v in step.phases_ms.items())
        print(
            f"  {(end - step.launched_at) * 1e3:8.1f} {step.host_ms:8.1f} {step.device_ms:8.1f}"
            f" {step.prompt_tokens:>7} {step.decode_tokens:>5} {step.launched_at - start:7.2f}"
            f"  {phases}"
        )
    _print_phases(steps)
    for at, seconds, name in recorder.compiles:
        print(f"  compile at {at - start:7.2f} s: {seconds:6.2f} s {name}")
    pauses = [(at - start, s, g) for at, s, g in recorder.gc_pauses if at >= start]
    print(
        f"  gc: {len(pauses)} pauses (gen 2 or > 10 ms), {sum(p[1] for p in pauses):.3f} s: "
        + " ".join(f"{at:.2f}s/{s * 1e3:.0f}ms/g{g}" for at, s, g in pauses[:12])
    )
    return {
        "total_s": total,
        "output_tok_per_s": made / total,
        "steps": len(steps),
        "groups": rows,
        "compiles": [(at - start, s, n) for at, s, n in recorder.compiles],
        "slowest": [asdict(s) for s, _ in slowest],
    }


def _print_phases(steps: list[Step]) -> None:
    """Mean host phases (ms) of the prompt steps and of the decode steps, and the run's totals."""
    for label, chosen in (
        ("prompt steps (ms)", [s for s in steps if s.prompt_tokens]),
        ("decode steps (ms)", [s for s in steps if not s.prompt_tokens]),
        ("the run, total (s)", steps),
    ):
        sums: dict[str, float] = defaultdict(float)
        for step in chosen:
            for name, ms in step.phases_ms.items():
                sums[name] += ms
        scale = 1e-3 if chosen is steps else 1 / max(len(chosen), 1)
        phases = " ".join(f"{k}={v * scale:.2f}" for k, v in sums.items())
        if chosen:
            print(f"  host phases of {label}: {phases}")


def _decode_label(group: int) -> str:
    return f"decode {group * 32 + 1}-{group * 32 + 32}"


def _kernel_report(recorder: Recorder) -> dict[str, Any]:
    if not recorder.kernels:
        return {}
    per_category: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, float] = defaultdict(float)
    steps = len(recorder.kernels)
    for records in recorder.kernels:
        for record in records:
            per_category[category(record)] += record.busy_us / 1e3 / steps
            per_kernel[record.name[:70]] += record.busy_us / 1e3 / steps
    print(f"device time of {steps} prompt steps by kernel, ms a step (profiled alone):")
    for name, ms in sorted(per_category.items(), key=lambda p: -p[1]):
        print(f"  {name:<10}{ms:8.2f}")
    for name, ms in sorted(per_kernel.items(), key=lambda p: -p[1])[:10]:
        print(f"    {ms:8.2f}  {name}")
    calls = sorted(recorder.host_calls.items(), key=lambda p: -p[1])[:6]
    print("  host CUDA calls, ms a step: " + ", ".join(f"{n} {ms / steps:.1f}" for n, ms in calls))
    return {
        "ms_per_step": dict(per_category),
        "top_kernels": dict(per_kernel),
        "host_cuda_calls_ms": {n: ms / steps for n, ms in calls},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--workload", choices=list(KINDS), default="standard")
    parser.add_argument("--workload-file", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile-prompt-steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args, pairs = parser.parse_known_args()
    kwargs = {"load_format": "dummy", "dtype": "bfloat16", "seed": 0} | _engine_kwargs(pairs)
    llm = LLM(args.preset, **kwargs)
    vocab = llm.llm_engine.model_config.vocab_size
    work = _load_workload(args, vocab)
    recorder = Recorder()
    recorder.install(llm.llm_engine.engine_core)
    rng = random.Random(
        -1
    )  # warm-up prompts of the first two's lengths, not theirs (no cache hits)
    warm = [[rng.randrange(vocab) for _ in p] for p in work.prompts[:2]]
    llm.generate(warm, [SamplingParams(max_tokens=8, ignore_eos=True)] * 2, use_tqdm=False)
    print(
        f"{args.preset} {args.workload_file or args.workload}: {len(work.prompts)} requests, "
        f"{sum(work.input_lens):,} prompt tokens, {work.output_tokens:,} output tokens"
    )
    result: dict[str, Any] = {"preset": args.preset, "workload": args.workload, "runs": []}
    for run in range(args.runs):
        print(f"-- run {run + 1}")
        recorder.profile_left = args.profile_prompt_steps if run == args.runs - 1 else 0
        result["runs"].append(_timed_run(llm, recorder, _fresh_prompts(work, vocab, run)))
    result["prompt_step_kernels"] = _kernel_report(recorder)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
