"""The step-time breakdown: the classifier on synthetic and real profiles, and on engine steps
(through the attention and sampling ranges the engine marks): a few decode steps, or one step in
N of a whole run."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from attnserve.bench.breakdown import (
    CATEGORIES,
    OpRecord,
    attribute,
    category,
    format_breakdown,
    kernel_records,
    op_records,
    profile_engine,
    profile_run,
)
from attnserve.bench.common import Workload
from attnserve.profiling import ATTENTION_RANGE, NATIVE_RANGE, SAMPLING_RANGE
from attnserve.sampling_params import SamplingParams

RECORDS = [
    OpRecord("aten::bmm", (ATTENTION_RANGE, "LlamaAttention"), 300.0),  # the range wins
    OpRecord("aten::mm", ("aten::matmul", "aten::linear"), 500.0),
    OpRecord("aten::t", ("aten::linear",), 100.0),  # part of a matmul op
    OpRecord("aten::argmax", (SAMPLING_RANGE,), 200.0),
    OpRecord("aten::add", ("LlamaModel",), 400.0),
]


def test_category_follows_ranges_then_matmul_ops() -> None:
    assert [category(r) for r in RECORDS] == [
        "attention",
        "matmul",
        "matmul",
        "sampling",
        "other",
    ]


def test_a_native_call_is_the_work_of_the_range_around_it() -> None:
    """CPU_NATIVE's attention kernel is one native call inside the attention range: attention;
    a native call outside the attention and sampling ranges (a packed matmul) is "native"."""
    inside = OpRecord(NATIVE_RANGE, (ATTENTION_RANGE, "LlamaAttention"), 50.0)
    outside = OpRecord(NATIVE_RANGE, ("aten::linear", "LlamaMLP"), 50.0)
    assert [category(inside), category(outside)] == ["attention", "native"]


def test_attribute_sums_to_the_step_time() -> None:
    breakdown = attribute(RECORDS, steps=2, wall_ms=1.0, source="test")
    assert breakdown.ms == {
        "attention": 0.15,
        "matmul": 0.3,
        "native": 0.0,
        "sampling": 0.1,
        "other": 0.2,
        "host": pytest.approx(0.25),
    }
    assert breakdown.step_ms == pytest.approx(1.0)
    assert sum(breakdown.share(c) for c in CATEGORIES) == pytest.approx(1.0)
    assert "attention" in format_breakdown(breakdown)


def test_host_overhead_is_never_negative() -> None:
    breakdown = attribute(RECORDS, steps=1, wall_ms=0.5, source="test")
    assert breakdown.ms["host"] == 0.0
    assert breakdown.step_ms == pytest.approx(1.5)


def test_attribute_needs_a_step() -> None:
    with pytest.raises(ValueError, match="at least one step"):
        attribute(RECORDS, steps=0, wall_ms=1.0, source="test")


def test_op_records_of_a_real_profile() -> None:
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(ATTENTION_RANGE):
            torch.softmax(a @ a, dim=-1)
        torch.nn.functional.linear(a, a)
        with record_function(SAMPLING_RANGE):
            torch.argmax(a, dim=-1)
        torch.relu(a)
    records = op_records(prof.events())
    assert all(r.name not in (ATTENTION_RANGE, SAMPLING_RANGE) for r in records)
    found = {category(r) for r in records}
    assert found == {"attention", "matmul", "sampling", "other"}


def test_engine_steps_have_attention_and_sampling() -> None:
    from attnserve.entrypoints.llm import LLM

    llm = LLM("llama-tiny", load_format="dummy", device="cpu", kv_cache_memory_bytes=8 << 20)
    workload = Workload([[5] * 20, [7] * 9, [9] * 33], [12, 12, 12])
    breakdown = profile_engine(llm.llm_engine, workload, steps=3)
    assert breakdown.steps == 3
    assert sum(breakdown.ms.values()) == pytest.approx(breakdown.step_ms)
    for name in ("attention", "matmul", "sampling"):
        assert breakdown.ms[name] > 0, name
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_whole_run_profiled_one_step_in_n() -> None:
    """Every step of the run is one of the sampled run's: floor(steps / N) of them profiled,
    prompt-bearing ones among the rest; each request runs to its end."""
    from attnserve.entrypoints.llm import LLM

    llm = LLM(
        "llama-tiny",
        load_format="dummy",
        device="cpu",
        enforce_eager=True,
        kv_cache_memory_bytes=8 << 20,
        attention_backend="CPU_NATIVE",
    )
    engine = llm.llm_engine
    workload = Workload([[5] * 20, [7] * 9, [9] * 33], [12, 5, 9])
    before = engine.stats()["num_steps"]
    breakdown = profile_run(engine, workload, every=4)
    steps = engine.stats()["num_steps"] - before
    assert steps >= 12 and breakdown.steps == steps // 4
    assert breakdown.ms["attention"] > 0  # the native attention kernel's calls
    assert sum(breakdown.share(c) for c in CATEGORIES) == pytest.approx(1.0)
    assert breakdown.scope == "step of the whole run"
    assert "time per step of the whole run, 3 profiled steps" in format_breakdown(breakdown)
    assert not engine.has_unfinished_requests()
    every_step = profile_run(engine, workload, every=1)
    assert every_step.steps == steps and "profiler overhead" in every_step.source


def test_a_sampled_run_refuses_bad_settings() -> None:
    from attnserve.entrypoints.llm import LLM

    llm = LLM("llama-tiny", load_format="dummy", device="cpu", kv_cache_memory_bytes=8 << 20)
    workload = Workload([[5] * 8], [3])
    with pytest.raises(ValueError, match="N >= 1, got 0"):
        profile_run(llm.llm_engine, workload, every=0)
    with pytest.raises(ValueError, match="fewer than the 50 a profile needs"):
        profile_run(llm.llm_engine, workload, every=50)
    llm.llm_engine.add_request("busy", [5] * 8, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="from a fresh start"):
        profile_run(llm.llm_engine, workload, every=2)


def _span(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_kernels_belong_to_what_was_open_around_their_launch() -> None:
    """A Triton kernel's launch (cuLaunchKernel) is no aten op: the range open on the launching
    thread places it; a launch on another thread, or a kernel with no launch, is "other"."""
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "thread_name", "tid": 1},
            _span("user_annotation", ATTENTION_RANGE, 0, 100),
            _span("cuda_driver", "cuLaunchKernel", 10, 5, correlation=1),
            _span("cpu_op", "aten::linear", 200, 50),
            _span("cpu_op", "aten::mm", 210, 30),
            _span("cuda_runtime", "cudaLaunchKernel", 220, 5, correlation=2),
            _span("user_annotation", SAMPLING_RANGE, 300, 50),
            _span("cuda_runtime", "cudaLaunchKernel", 310, 5, correlation=3),
            _span("cuda_runtime", "cudaLaunchKernel", 20, 5, tid=2, correlation=4),
            _span("kernel", "paged_decode", 1000, 40.0, tid=7, correlation=1),
            _span("kernel", "sm90_gemm", 1100, 60.0, tid=7, correlation=2),
            _span("kernel", "argmax", 1200, 8.0, tid=7, correlation=3),
            _span("kernel", "elementwise", 1300, 2.0, tid=7, correlation=4),
            _span("kernel", "orphan", 1400, 1.0, tid=7),
        ]
    }
    records = kernel_records(trace)
    assert [(r.name, category(r)) for r in records] == [
        ("paged_decode", "attention"),
        ("sm90_gemm", "matmul"),
        ("argmax", "sampling"),
        ("elementwise", "other"),
        ("orphan", "other"),
    ]
    breakdown = attribute(records, steps=1, wall_ms=1.0, source="test")
    assert breakdown.ms["attention"] == pytest.approx(0.040)
    assert breakdown.ms["other"] == pytest.approx(0.003)


def test_native_kernel_calls_are_timed_as_their_own_category() -> None:
    """The packed default model on the CPU runs its layers as native calls, which no torch op
    shows: they are "native", not host time."""
    from attnserve.entrypoints.llm import LLM

    llm = LLM(device="cpu", enforce_eager=True, max_model_len=256)
    workload = Workload([[5] * 20, [7] * 9], [12, 12])
    breakdown = profile_engine(llm.llm_engine, workload, steps=3)
    assert breakdown.ms["native"] > 0
    assert breakdown.share("native") > breakdown.share("host") / 4
    assert not llm.llm_engine.has_unfinished_requests()
