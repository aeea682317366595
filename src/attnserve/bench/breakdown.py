"""Where an engine step's time goes: attention, matmuls, sampling, other device work, and host
overhead, from engine steps under `torch.profiler`.

`profile_engine` profiles a few steps once every prompt is prefilled (decode with the whole batch);
`profile_run` runs a whole workload from a fresh start and profiles one step in every N
(`torch.profiler.schedule`), so steps that carry prompt tokens count in proportion. Work is
attributed by where it was launched, never by kernel or backend names: work under the
`ATTENTION_RANGE` or `SAMPLING_RANGE` record_function range (attnserve.profiling) belongs to the
innermost of them; other work under the `NATIVE_RANGE` (one call of a native C kernel, on the CPU,
whose time no torch op shows) is "native" (a native attention kernel, CPU_NATIVE's, is attention);
otherwise work that is, or runs under, a matmul op (aten::mm, addmm, linear, ...) is a matmul;
everything else is "other". On the host an op's time is its CPU self time, placed by the profiler's
op tree. On a GPU the time is each kernel's, placed by the ranges and ops open on the launching
thread when its launch call ran (read from the profile's Chrome trace, which links every kernel to
its launch, whichever library launched it); run the engine eagerly, since CUDA graphs hide their
kernels (and CPU graphs their native calls). Host overhead = wall time per step minus that busy time
(0 when the profiler's figures exceed it): for `profile_engine`, timed over as many steps without
the profiler; for `profile_run`, the mean of the same run's unprofiled steps (with N = 1, of the
profiled ones, profiler overhead included: the breakdown's source says so).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from attnserve.bench.common import Workload, sampling_params, sync
from attnserve.engine.llm_engine import LLMEngine
from attnserve.profiling import ATTENTION_RANGE, NATIVE_RANGE, SAMPLING_RANGE

# Kineto (the profiler's C++ side) prints a line to stderr at each profile's start and stop
# unless its log level is past its last (5); it reads the variable once, when first started.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

CATEGORIES = ("attention", "matmul", "native", "sampling", "other", "host")
MATMUL_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm", "aten::baddbmm"}
)
_RANGES = {ATTENTION_RANGE: "attention", SAMPLING_RANGE: "sampling", NATIVE_RANGE: "native"}
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # a Chrome trace's launch calls
_SCOPE_CATEGORIES = ("cpu_op", "user_annotation")


@dataclass(frozen=True)
class OpRecord:
    """One profiled op: its name, the names of its enclosing ops and ranges (innermost first),
    and its busy time in µs (its kernels' time on a GPU, its CPU self time on the host)."""

    name: str
    ancestors: tuple[str, ...]
    busy_us: float


@dataclass(frozen=True)
class Breakdown:
    steps: int
    step_ms: float
    ms: dict[str, float]  # per step, one entry per CATEGORIES
    source: str
    scope: str = "decode step"  # the steps profiled: "time per {scope}"

    def share(self, category: str) -> float:
        return self.ms[category] / self.step_ms if self.step_ms else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "step_ms": self.step_ms,
            "ms_per_step": self.ms,
            "share": {c: self.share(c) for c in CATEGORIES},
            "source": self.source,
            "scope": self.scope,
        }


def category(record: OpRecord) -> str:
    """The category of CATEGORIES (host excepted) that `record`'s time belongs to."""
    chain = (record.name, *record.ancestors)
    ranges = [_RANGES[name] for name in chain if name in _RANGES]
    if ranges:  # a native call inside the attention or sampling range is that range's work
        return next((found for found in ranges if found != "native"), "native")
    return "matmul" if any(name in MATMUL_OPS for name in chain) else "other"


def attribute(
    records: Iterable[OpRecord],
    steps: int,
    wall_ms: float,
    source: str,
    scope: str = "decode step",
) -> Breakdown:
    """Per-step milliseconds per category; host = `wall_ms` per step minus the busy time."""
    if steps < 1:
        raise ValueError(f"the breakdown needs at least one step, got {steps}")
    ms = dict.fromkeys(CATEGORIES, 0.0)
    for record in records:
        ms[category(record)] += record.busy_us / 1000 / steps
    busy = sum(ms.values())
    ms["host"] = max(0.0, wall_ms - busy)
    return Breakdown(steps, busy + ms["host"], ms, source, scope)


def _ancestors(event: FunctionEvent) -> tuple[str, ...]:
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


def op_records(events: Iterable[FunctionEvent]) -> list[OpRecord]:
    """Host-side ops of a profile (ranges are ancestors, not work) as OpRecords."""
    records = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_async:
            continue
        if event.is_user_annotation or event.name in _RANGES:
            if event.name == NATIVE_RANGE:  # a native call: no torch op inside to time it
                records.append(OpRecord(NATIVE_RANGE, _ancestors(event), event.cpu_time_total))
            continue
        if event.self_cpu_time_total > 0:
            records.append(OpRecord(event.name, _ancestors(event), event.self_cpu_time_total))
    return records


def kernel_records(trace: dict[str, Any]) -> list[OpRecord]:
    """The GPU kernels of a Chrome trace (torch.profiler's export) as OpRecords: a kernel's
    ancestors are the ranges and matmul ops that held, on its thread, the call that launched it."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: (e["tid"], e["ts"])
        for e in events
        if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    scopes = [
        (e["tid"], e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") in _SCOPE_CATEGORIES and (e["name"] in _RANGES or e["name"] in MATMUL_OPS)
    ]
    records = []
    for kernel in (e for e in events if e.get("cat") == "kernel"):
        thread, at = launches.get(kernel.get("args", {}).get("correlation"), (None, 0.0))
        held = tuple(
            name for tid, start, end, name in scopes if tid == thread and start <= at <= end
        )
        records.append(OpRecord(kernel["name"], held, float(kernel["dur"])))
    return records


def _add_requests(engine: LLMEngine, workload: Workload) -> list[str]:
    """Add the workload's requests (greedy, ignore_eos, each its output length); their ids."""
    ids = []
    for index, (prompt, params) in enumerate(
        zip(workload.prompts, sampling_params(workload), strict=True)
    ):
        ids.append(f"profile-{index}")
        engine.add_request(ids[-1], prompt, params)
    return ids


def _prefill_everything(engine: LLMEngine, workload: Workload) -> list[str]:
    """Add the workload's requests and step until each has drawn its first token; their ids."""
    ids = _add_requests(engine, workload)
    scheduler = engine.engine_core.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()
    return ids


def _timed_steps(engine: LLMEngine, steps: int) -> tuple[int, float]:
    """(steps run, wall ms per step) of up to `steps` engine steps."""
    sync()
    started, done = time.perf_counter(), 0
    while done < steps and engine.has_unfinished_requests():
        engine.step()
        done += 1
    sync()
    return done, (time.perf_counter() - started) * 1000 / max(done, 1)


def profile_engine(engine: LLMEngine, workload: Workload, steps: int) -> Breakdown:
    """The breakdown of `steps` decode steps of `workload` (see the module docstring)."""
    on_device = engine.config.device.type == "cuda"
    request_ids = _prefill_everything(engine, workload)
    _timed_steps(engine, 1)  # lets the first decode step's one-off work out of the figures
    timed, wall_ms = _timed_steps(engine, steps)
    with profile(activities=_activities(on_device)) as prof:
        profiled, _ = _timed_steps(engine, steps)
    for request_id in request_ids:
        engine.abort_request(request_id)
    if not timed or not profiled:
        raise ValueError("the workload is too short for --profile-steps: use longer outputs")
    return attribute(_profile_records(prof, on_device), profiled, wall_ms, _source(on_device))


def _activities(on_device: bool) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])


def _source(on_device: bool) -> str:
    return "GPU kernel time, engine run eagerly" if on_device else "CPU self time"


def _profile_records(prof: profile, on_device: bool) -> list[OpRecord]:
    """The records of a finished profile (of one schedule cycle, under `on_trace_ready`): its
    kernels, from its Chrome trace, on a GPU; its host ops on the CPU."""
    if not on_device:
        return op_records(prof.events())
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return kernel_records(json.load(file))


@contextmanager
def _every_nth_step(every: int, on_device: bool, records: list[OpRecord]) -> Iterator[profile]:
    """A profiler that records steps every-1, 2*every-1, ... (counting from 0; `prof.step()`
    after each) and adds each recorded step's records to `records` as its cycle ends. No step
    is a warm-up, and each cycle's events are taken as it ends: torch's warnings about both
    are silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Profiler won't be using warmup")
        warnings.filterwarnings("ignore", "Warning: Profiler clears events")
        with profile(
            activities=_activities(on_device),
            schedule=schedule(wait=every - 1, warmup=0, active=1),
            on_trace_ready=lambda prof: records.extend(_profile_records(prof, on_device)),
        ) as prof:
            yield prof


def profile_run(engine: LLMEngine, workload: Workload, every: int) -> Breakdown:
    """The breakdown of a whole run of `workload` on an engine with no requests, one step in
    every `every` profiled (see the module docstring)."""
    if every < 1:
        raise ValueError(f"profiling one step in every N needs N >= 1, got {every}")
    if engine.has_unfinished_requests():
        raise ValueError("profile_run runs a workload from a fresh start: requests are unfinished")
    on_device = engine.config.device.type == "cuda"
    records: list[OpRecord] = []
    seconds, steps = [0.0, 0.0], [0, 0]  # [unprofiled, profiled]
    _add_requests(engine, workload)
    with _every_nth_step(every, on_device, records) as prof:
        while True:
            profiled = int(prof.current_action != ProfilerAction.NONE)
            started = time.perf_counter()
            engine.step()
            seconds[profiled] += time.perf_counter() - started
            steps[profiled] += 1
            if not engine.has_unfinished_requests():
                break  # no prof.step(): it would start recording a step that never runs
            prof.step()
    if not steps[1]:
        raise ValueError(f"the run took {steps[0]} steps, fewer than the {every} a profile needs")
    timed = 0 if steps[0] else 1
    wall_ms = seconds[timed] * 1000 / steps[timed]
    wall = "unprofiled steps' wall time" if steps[0] else "wall time with profiler overhead"
    source = f"{_source(on_device)}, 1 step in {every} of the whole run; {wall}"
    return attribute(records, steps[1], wall_ms, source, scope="step of the whole run")


def format_breakdown(breakdown: Breakdown) -> str:
    lines = [
        f"time per {breakdown.scope}, {breakdown.steps} profiled steps ({breakdown.source}):",
        f"  {'category':<10} {'ms/step':>9} {'share':>6}",
    ]
    for name in CATEGORIES:
        lines.append(f"  {name:<10} {breakdown.ms[name]:>9.3f} {breakdown.share(name):>6.1%}")
    lines.append(f"  {'step':<10} {breakdown.step_ms:>9.3f}")
    return "\n".join(lines)
