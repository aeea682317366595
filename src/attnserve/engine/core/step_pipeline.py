"""`StepPipeline`: the engine's side of a step in flight — launched on the executor, read back,
its draws put in place.

At most one step is in flight. `launch` sends the scheduled step's plan down, then reads back
the step before it (whose draws the new step may already be reading on the device: async
scheduling), then counts the new step's tokens as computed; `drain` reads back the step in
flight, if any. Reading back counts the drafts verified and accepted (speculative decoding:
`spec_stats`), hands each sequence its draws (the scheduler forks and finishes them), then
advances the grammars of constrained sequences.

A step with constrained draws is launched in two halves: its forward pass first
(`launch_forward`), then, once the step before is read back and the matchers have taken its
tokens, its token bitmask, which launches its draws (`LaunchedForward.sample`). So the device
runs the forward pass while the host reads the tokens back and fills the bitmask, and
constrained steps keep async scheduling.
"""

from __future__ import annotations

from attnserve.engine.core.constrained_decoding import StructuredOutputManager
from attnserve.engine.core.scheduler import Scheduler, SchedulerOutput
from attnserve.engine.core.sequence import Sequence
from attnserve.engine.core.step_planner import StepPlanner
from attnserve.executor.executor_base import ExecutorBase
from attnserve.spec_decode.metrics import SpecDecodeStats
from attnserve.step_types import AsyncStepOutput


class StepPipeline:
    def __init__(
        self,
        executor: ExecutorBase,
        scheduler: Scheduler,
        structured_outputs: StructuredOutputManager,
        eos_token_ids: list[int],
        spec_stats: SpecDecodeStats | None = None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.structured_outputs = structured_outputs
        self.eos_token_ids = eos_token_ids
        self.spec_stats = spec_stats
        self.planner = StepPlanner()
        self._in_flight: tuple[SchedulerOutput, AsyncStepOutput] | None = None

    @property
    def busy(self) -> bool:
        """Whether a step is in flight."""
        return self._in_flight is not None

    def launch(self, scheduled: SchedulerOutput) -> list[Sequence]:
        """Launch `scheduled`, then drain the step before it; the sequences that drained (a
        step with constrained draws: its forward pass, the drain, then its draws)."""
        plan = self.planner.plan(scheduled)
        drawing = [item.seq for item in scheduled.scheduled if item.samples]
        if any(seq.grammar is not None for seq in drawing):
            forward = self.executor.launch_forward(plan)
            touched = self.drain()
            launched = forward.sample(self.structured_outputs.token_bitmask(drawing))
        else:
            launched = self.executor.execute_model_async(plan)
            touched = self.drain()
        self.scheduler.advance(scheduled)
        self._in_flight = (scheduled, launched)
        return touched

    def drain(self) -> list[Sequence]:
        """Read back the step in flight, if there is one; the sequences that got a token."""
        if self._in_flight is None:
            return []
        scheduled, future = self._in_flight
        self._in_flight = None
        results = future.result()
        if self.spec_stats is not None:  # (a sequence ended meanwhile verified nothing)
            drafts = [[] if i.seq.is_finished else i.spec_token_ids for i in scheduled.scheduled]
            self.spec_stats.observe(drafts, results)
        touched = self.scheduler.resolve(scheduled, results, self.eos_token_ids)
        for seq, reason in self.structured_outputs.advance(touched):
            self.scheduler.finish(seq, reason)
        return touched
