"""Where a request's latency goes, stage by stage, summed over every request the server serves
and exported on `/metrics` (`attnserve bench serve` prints the means).

A first token passes, in order (each stage ends at the named moment, `time.monotonic()`, one clock
for the front end and the engine core process):

| stage | ends when |
| --- | --- |
| `tokenize` | the prompt is tokenized and checked (from the handler's start) |
| `submit` | the request is handed to the engine core |
| `queue` | a core step first takes the request (it waits for a step, and for room) |
| `step` | the core reads its first token back (its prompt's steps on the device) |
| `report` | the core hands the step's outputs over |
| `pipe` | the front end's output thread takes them (the channel, and its backlog) |
| `process` | they are detokenized, stop strings checked, outputs built |
| `deliver` | the request's coroutine has them (the event loop's backlog) |
| `write` | its SSE chunk is handed to the socket (rendering, JSON, sending) |

Every later token (each output a stream writes) passes `core` (the gap since the same request's
previous output left the core: its share of the token gap), then `pipe`, `process`, `deliver`
and `write`. Each stage is a Prometheus summary (`..._sum` seconds and `..._count`) by `stage`:
`attnserve:first_token_stage_seconds` and `attnserve:token_stage_seconds`. Per engine step, as the
front end's output thread counts them (`LLMEngine.step_stats`): `attnserve:step_stage_seconds`
with `interval` (between the core's hand-overs) and `backlog` (from a hand-over until the output
thread took it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from attnserve.engine.llm_engine import StepStats
from attnserve.outputs import RequestOutput, StepTimings

PREFIX = "attnserve:"
FIRST_TOKEN_STAGES = (
    "tokenize", "submit", "queue", "step", "report", "pipe", "process", "deliver", "write",
)  # fmt: skip
TOKEN_STAGES = ("core", "pipe", "process", "deliver", "write")


class StageTotals:
    """Seconds and counts per stage, added up as requests go (a float add: cheap per token)."""

    def __init__(self, stages: tuple[str, ...]) -> None:
        self.seconds = dict.fromkeys(stages, 0.0)
        self.counts = dict.fromkeys(stages, 0)

    def add(self, stage: str, start: float, end: float) -> None:
        """The stage from `start` to `end`, where both are known (not 0.0)."""
        if start and end:
            self.seconds[stage] += max(end - start, 0.0)
            self.counts[stage] += 1

    def family(self, name: str, doc: str) -> SummaryMetricFamily:
        family = SummaryMetricFamily(PREFIX + name, doc, labels=["stage"])
        for stage, seconds in self.seconds.items():
            family.add_metric([stage], self.counts[stage], seconds)
        return family


class LatencyBreakdown(Collector):
    """The server's stage totals, collected into its registry."""

    def __init__(self, steps: Callable[[], StepStats]) -> None:
        self.first_token = StageTotals(FIRST_TOKEN_STAGES)
        self.token = StageTotals(TOKEN_STAGES)
        self.steps = steps

    def request(self, received: float, tokenized: float, submitted: float) -> None:
        """A request's way in: from its handler's start to the engine core."""
        self.first_token.add("tokenize", received, tokenized)
        self.first_token.add("submit", tokenized, submitted)

    def delivered(self, output: RequestOutput, step: StepTimings, now: float, first: bool) -> None:
        """`output`, of `step`, reached its request's coroutine at `now`."""
        totals = self.first_token if first else self.token
        if first:
            totals.add("queue", output.submitted, output.scheduled)
            totals.add("step", output.scheduled, step.drawn)
            totals.add("report", step.drawn, step.handed_back)
        totals.add("pipe", step.handed_back, step.taken)
        totals.add("process", step.taken, step.processed)
        totals.add("deliver", step.processed, now)

    def core_gap(self, previous: StepTimings, step: StepTimings) -> None:
        """A request's output of `step` came `step.handed_back - previous.handed_back` after its
        output before it left the core."""
        self.token.add("core", previous.handed_back, step.handed_back)

    def written(self, delivered: float, now: float, first: bool) -> None:
        """A chunk delivered at `delivered` was handed to the socket at `now`."""
        (self.first_token if first else self.token).add("write", delivered, now)

    def collect(self) -> Iterator[Metric]:
        yield self.first_token.family(
            "first_token_stage_seconds", "a first token's time in each stage on its way out"
        )
        yield self.token.family(
            "token_stage_seconds", "a later token's time in each stage on its way out"
        )
        stats = self.steps()
        family = SummaryMetricFamily(
            PREFIX + "step_stage_seconds",
            "per engine step: the interval between the core's hand-overs, and how long the step "
            "waited for the front end (its backlog)",
            labels=["stage"],
        )
        family.add_metric(["interval"], stats.steps, stats.interval_s)
        family.add_metric(["backlog"], stats.steps, stats.backlog_s)
        yield family
