"""Where an engine step's time goes: attention, matmuls, sampling, other device work, and host
overhead, from a few engine steps under `torch.profiler`.

Steps are profiled once every prompt is prefilled (decode with the whole batch). Work is
attributed by where it was launched, never by kernel or backend names: work under the
`ATTENTION_RANGE`, `SAMPLING_RANGE` or `NATIVE_RANGE` record_function range
(attnserve.profiling; the last is one call of a native C kernel, on the CPU, whose time no torch
op shows) belongs to the innermost such range; otherwise work that is, or runs under, a matmul
op (aten::mm, addmm, linear, ...) is a matmul; everything else is "other". On the host an op's
time is its CPU self time, placed by the profiler's op tree. On a GPU the time is each kernel's,
placed by the ranges and ops open on the launching thread when its launch call ran (read from
the profile's Chrome trace, which links every kernel to its launch, whichever library launched
it); run the engine eagerly, since CUDA graphs hide their kernels (and CPU graphs their native
calls). Host overhead = wall time per step, timed over as many steps without the profiler, minus
that busy time (0 when the profiler's figures exceed it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

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

    def share(self, category: str) -> float:
        return self.ms[category] / self.step_ms if self.step_ms else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "step_ms": self.step_ms,
            "ms_per_step": self.ms,
            "share": {c: self.share(c) for c in CATEGORIES},
            "source": self.source,
        }


def category(record: OpRecord) -> str:
    """The category of CATEGORIES (host excepted) that `record`'s time belongs to."""
    chain = (record.name, *record.ancestors)
    for name in chain:
        if name in _RANGES:
            return _RANGES[name]
    return "matmul" if any(name in MATMUL_OPS for name in chain) else "other"


def attribute(records: Iterable[OpRecord], steps: int, wall_ms: float, source: str) -> Breakdown:
    """Per-step milliseconds per category; host = `wall_ms` per step minus the busy time."""
    if steps < 1:
        raise ValueError(f"the breakdown needs at least one step, got {steps}")
    ms = dict.fromkeys(CATEGORIES, 0.0)
    for record in records:
        ms[category(record)] += record.busy_us / 1000 / steps
    busy = sum(ms.values())
    ms["host"] = max(0.0, wall_ms - busy)
    return Breakdown(steps, busy + ms["host"], ms, source)


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


def _prefill_everything(engine: LLMEngine, workload: Workload) -> list[str]:
    """Add the workload's requests and step until each has drawn its first token; their ids."""
    ids = []
    for index, (prompt, params) in enumerate(
        zip(workload.prompts, sampling_params(workload), strict=True)
    ):
        ids.append(f"profile-{index}")
        engine.add_request(ids[-1], prompt, params)
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
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        profiled, _ = _timed_steps(engine, steps)
    for request_id in request_ids:
        engine.abort_request(request_id)
    if not timed or not profiled:
        raise ValueError("the workload is too short for --profile-steps: use longer outputs")
    if not on_device:
        return attribute(op_records(prof.events()), profiled, wall_ms, "CPU self time")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            trace = json.load(file)
    source = "GPU kernel time, engine run eagerly"
    return attribute(kernel_records(trace), profiled, wall_ms, source)


def format_breakdown(breakdown: Breakdown) -> str:
    lines = [
        f"time per decode step, {breakdown.steps} profiled steps ({breakdown.source}):",
        f"  {'category':<10} {'ms/step':>9} {'share':>6}",
    ]
    for name in CATEGORIES:
        lines.append(f"  {name:<10} {breakdown.ms[name]:>9.3f} {breakdown.share(name):>6.1%}")
    lines.append(f"  {'step':<10} {breakdown.step_ms:>9.3f}")
    return "\n".join(lines)
