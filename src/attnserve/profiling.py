"""Names of the `torch.profiler.record_function` ranges the engine marks, so that tools reading a
profile (`attnserve bench throughput`'s time breakdown) can attribute work without knowing which
attention backend or sampler ran it."""

from __future__ import annotations

ATTENTION_RANGE = "attnserve.attention"
SAMPLING_RANGE = "attnserve.sampling"
