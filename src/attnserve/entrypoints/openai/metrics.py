"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own.

Gauges read the engine's `stats()` at scrape time: running / waiting / swapped requests, KV cache
usage (0..1; 0 once idle means no block is leaked), prefix-cache hit rate, preemptions, and
`engine_healthy` (1, or 0 once the core is dead or hung: the queues and the KV usage then read
0, since nothing runs); with speculative decoding, its draft and accepted token counts, the
acceptance rate and the mean acceptance length. Counters: requests that failed, by reason,
requests refused at admission (`request_rejected_total`, by reason: `queue_full`; the queue
is `num_requests_queued`), and
engine-core restarts. The serving layer records, per request, time to first token, the time
per output token (each gap between outputs), end-to-end latency, the engine steps it
waited before a step first took it (`request_queue_steps`), prompt and generated tokens,
and finished requests; and the front end's own share of the first token's latency: from the
engine core handing over the step that drew it to the server handing it to the request's HTTP
response (`first_token_frontend_delay_seconds`); and every request's way out stage by stage
(`latency_breakdown`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from attnserve.engine.core_client import EngineDeadError
from attnserve.engine.llm_engine import StepStats
from attnserve.entrypoints.openai.latency_breakdown import LatencyBreakdown
from attnserve.outputs import RequestOutput, StepTimings

PREFIX = "attnserve:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
FRONTEND_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
QUEUE_STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

_GAUGES = {
    "num_running": ("num_requests_running", "requests in the running batch"),
    "num_waiting": ("num_requests_waiting", "requests waiting to be scheduled"),
    "num_swapped": ("num_requests_swapped", "requests swapped out to host memory"),
    "kv_cache_usage": ("kv_cache_usage_perc", "fraction of KV cache blocks in use (0..1)"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "fraction of prompt blocks found cached"),
}


_IDLE_WHEN_DEAD = ("num_running", "num_waiting", "num_swapped", "kv_cache_usage")
FAILURE_REASONS = ("engine_failed", "shutdown", "timeout")


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float]], healthy: Callable[[], bool]) -> None:
        self.stats = stats
        self.healthy = healthy
        self.last: dict[str, float] = dict.fromkeys([*_GAUGES, "num_preemptions"], 0.0)

    def collect(self) -> Iterator[Metric]:
        healthy = self.healthy()
        stats = self.last
        if healthy:
            with contextlib.suppress(EngineDeadError):  # it died just now: the last gauges
                stats = self.last = self.stats()
        for key, (name, doc) in _GAUGES.items():
            value = 0.0 if not healthy and key in _IDLE_WHEN_DEAD else stats[key]
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield CounterMetricFamily(
            PREFIX + "num_preemptions", "preemptions so far", value=stats["num_preemptions"]
        )
        yield from _spec_decode_metrics(stats)
        yield GaugeMetricFamily(
            PREFIX + "engine_healthy", "1 while the engine core serves, else 0", value=healthy
        )


_SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "sequence-steps that verified draft tokens",
    "spec_decode_num_draft_tokens": "draft tokens proposed and verified",
    "spec_decode_num_accepted_tokens": "draft tokens accepted",
}
_SPEC_DECODE_GAUGES = {
    "spec_decode_acceptance_rate": "share of draft tokens accepted",
    "spec_decode_mean_acceptance_length": "tokens a verified sequence gains per step",
}


def _spec_decode_metrics(stats: dict[str, float]) -> Iterator[Metric]:
    """Speculative decoding's counts and rates, where the engine speculates."""
    if "spec_decode_num_drafts" not in stats:
        return
    for key, doc in _SPEC_DECODE_COUNTERS.items():
        yield CounterMetricFamily(PREFIX + key, doc, value=stats[key])
    for key, doc in _SPEC_DECODE_GAUGES.items():
        yield GaugeMetricFamily(PREFIX + key, doc, value=stats[key])


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], dict[str, float]],
        healthy: Callable[[], bool] = lambda: True,
        steps: Callable[[], StepStats] = StepStats,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, healthy))
        self.breakdown = LatencyBreakdown(steps)
        self.registry.register(self.breakdown)
        r = self.registry
        self.failures = Counter(
            PREFIX + "request_failure", "requests ended by a failure, by reason", ["reason"],
            registry=r,
        )  # fmt: skip
        for reason in FAILURE_REASONS:
            self.failures.labels(reason)
        self.queued = Gauge(
            PREFIX + "num_requests_queued",
            "requests admitted by the server still waiting for their first output",
            registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            PREFIX + "request_rejected", "requests refused at admission, by reason", ["reason"],
            registry=r,
        )  # fmt: skip
        self.restarts = Counter(
            PREFIX + "engine_core_restarts", "engine cores started again after one died",
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "time to first token", buckets=TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds", "gap between outputs", buckets=TPOT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "request latency", buckets=E2E_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.frontend_delay = Histogram(
            PREFIX + "first_token_frontend_delay_seconds",
            "from the engine core handing over a request's first token to its response",
            buckets=FRONTEND_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_steps = Histogram(
            PREFIX + "request_queue_steps",
            "engine steps a request waited before a step first took it", buckets=QUEUE_STEP_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "generated tokens", registry=r
        )
        self.finished = Counter(
            PREFIX + "request_success", "finished requests", ["finished_reason"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, received: float, tokenized: float) -> RequestTracker:
        return RequestTracker(self, received, tokenized)


class RequestTracker:
    """One engine request's timings, fed each (delta) output as it arrives; `received`: when
    its API call's handler started, `tokenized`: when its prompt was ready (time.monotonic())."""

    def __init__(self, metrics: ServerMetrics, received: float, tokenized: float) -> None:
        self.metrics = metrics
        self.received = received
        self.tokenized = tokenized
        self.last: float | None = None
        self.last_step: StepTimings | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if new_tokens:
            last = self.last
            if last is None:
                self.metrics.ttft.observe(now - self.received)
                self.metrics.queue_steps.observe(output.queued_steps)
                self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                self.metrics.breakdown.request(self.received, self.tokenized, output.submitted)
            else:
                self.metrics.tpot.observe(now - last)
            self._stages(output, now, first=last is None)
            self.last = now
            self.metrics.generation_tokens.inc(new_tokens)
        if output.finished:
            self.metrics.e2e.observe(now - self.received)
            reason = output.outputs[0].finish_reason if output.outputs else None
            self.metrics.finished.labels(reason or "unknown").inc()

    def _stages(self, output: RequestOutput, now: float, first: bool) -> None:
        step = output.step_timings
        if step is None:
            return
        self.metrics.breakdown.delivered(output, step, now, first)
        if first and step.handed_back:
            self.metrics.frontend_delay.observe(max(now - step.handed_back, 0.0))
        if self.last_step is not None:
            self.metrics.breakdown.core_gap(self.last_step, step)
        self.last_step = step
