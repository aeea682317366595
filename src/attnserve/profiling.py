"""Names of the `torch.profiler.record_function` ranges the engine marks, so that tools reading a
profile (`attnserve bench throughput`'s time breakdown) can attribute work without knowing which
attention backend or sampler ran it; `marked` opens one only while a profiler records (a range
costs ~15 us of host time a call: 30 layers of a CPU decode step would pay ~0.4 ms)."""

from __future__ import annotations

import contextlib

import torch

ATTENTION_RANGE = "attnserve.attention"
SAMPLING_RANGE = "attnserve.sampling"
NATIVE_RANGE = "attnserve.native"  # one native (C) kernel call


def marked(name: str) -> contextlib.AbstractContextManager[object]:
    """The range `name` while a profiler records, else nothing."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
