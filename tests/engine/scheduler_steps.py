"""A scheduled step's results recorded in a `Scheduler` the way the engine core's step pipeline
records them (`engine/core/step_pipeline.py`): `advance` once the step is launched, then
`resolve` with its draws."""

from __future__ import annotations

from attnserve.engine.core.scheduler import Scheduler
from attnserve.engine.core.scheduler_output import SchedulerOutput
from attnserve.engine.core.sequence import Sequence
from attnserve.step_types import SampleOutput


def record_step(
    scheduler: Scheduler,
    out: SchedulerOutput,
    results: list[SampleOutput | None],
    eos_token_ids: list[int],
) -> list[Sequence]:
    """Record one step's results at once; the sequences that got a token, finished ones
    included."""
    scheduler.advance(out)
    return scheduler.resolve(out, results, eos_token_ids)
