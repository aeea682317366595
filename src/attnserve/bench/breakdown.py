"""Where an engine step's time goes: attention, matmuls, sampling, other device work, and host
overhead, from a few engine steps under `torch.profiler`.

Steps are profiled once every prompt is prefilled (decode with the whole batch). Work is attributed
by the profiler's op tree and time spans, never by kernel or backend names: an op under the
`ATTENTION_RANGE` or `SAMPLING_RANGE` record_function range (attnserve.profiling), or launched
while that range was open on its thread, belongs to that range; otherwise an op that is, or runs
under, a matmul op (aten::mm, addmm, linear, ...) is a matmul; everything else is "other". On a GPU
an op's time is that of the kernels it launched (so run the engine eagerly: CUDA graphs hide their
kernels); on the host it is the op's CPU self time. Host overhead = wall time per step, timed over
as many steps without the profiler, minus that busy time (0 when the profiler's figures exceed it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from attnserve.bench.common import Workload, sampling_params, sync
from attnserve.engine.llm_engine import LLMEngine
from attnserve.profiling import ATTENTION_RANGE, SAMPLING_RANGE

CATEGORIES = ("attention", "matmul", "sampling", "other", "host")
MATMUL_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm", "aten::baddbmm"}
)
_RANGES = {ATTENTION_RANGE: "attention", SAMPLING_RANGE: "sampling"}


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


def _ancestors(event: FunctionEvent, scopes: list[FunctionEvent]) -> tuple[str, ...]:
    """The names of `event`'s enclosing ops: its parents in the op tree, and every range or
    matmul op of its thread whose time span holds its start (a kernel launched outside an aten
    op, such as a Triton kernel's, hangs off a launch call that the op tree may not link to)."""
    names = []
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    start = event.time_range.start
    names += [
        scope.name
        for scope in scopes
        if scope is not event
        and scope.thread == event.thread
        and scope.time_range.start <= start <= scope.time_range.end
    ]
    return tuple(names)


def op_records(events: Iterable[FunctionEvent], on_device: bool) -> list[OpRecord]:
    """Host-side ops of a profile (ranges are ancestors, not work) as OpRecords."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    scopes = [e for e in host if e.name in _RANGES or e.name in MATMUL_OPS]
    records = []
    for event in host:
        if event.is_user_annotation or event.name in _RANGES:
            continue
        busy = sum(k.duration for k in event.kernels) if on_device else event.self_cpu_time_total
        if busy > 0:
            records.append(OpRecord(event.name, _ancestors(event, scopes), float(busy)))
    return records


def _prefill_everything(engine: LLMEngine, workload: Workload) -> None:
    """Add the workload's requests and step until each has drawn its first token."""
    for index, (prompt, params) in enumerate(
        zip(workload.prompts, sampling_params(workload), strict=True)
    ):
        engine.add_request(f"profile-{index}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_output_tokens == 0 for s in scheduler.running):
        engine.step()


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
    on_device = engine.runner.device.type == "cuda"
    _prefill_everything(engine, workload)
    _timed_steps(engine, 1)  # lets the first decode step's one-off work out of the figures
    timed, wall_ms = _timed_steps(engine, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        profiled, _ = _timed_steps(engine, steps)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    if not timed or not profiled:
        raise ValueError("the workload is too short for --profile-steps: use longer outputs")
    source = "GPU kernel time, engine run eagerly" if on_device else "CPU self time"
    return attribute(op_records(prof.events(), on_device), profiled, wall_ms, source)


def format_breakdown(breakdown: Breakdown) -> str:
    lines = [
        f"time per decode step, {breakdown.steps} profiled steps ({breakdown.source}):",
        f"  {'category':<10} {'ms/step':>9} {'share':>6}",
    ]
    for name in CATEGORIES:
        lines.append(f"  {name:<10} {breakdown.ms[name]:>9.3f} {breakdown.share(name):>6.1%}")
    lines.append(f"  {'step':<10} {breakdown.step_ms:>9.3f}")
    return "\n".join(lines)
