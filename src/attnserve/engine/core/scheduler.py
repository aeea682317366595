"""`Scheduler`: continuous batching with chunked prefill, prefix caching and preemption.

The policy, once per step, within `max_num_seqs` sequences and `max_num_batched_tokens` tokens:
1. Running decodes first, oldest first, one token each: a decode never waits behind a prompt.
   With speculative decoding a decode also carries the draft tokens proposed for it (as many as
   the budget and the free blocks allow), verified in the same step.
2. Then running sequences still in their prompt, oldest first, each taking as much of the rest
   of it as the budget left allows (so the oldest prompt always advances while any budget is
   left, and new prompts are not admitted while the budget is spent: none starves). When a running
   sequence needs a block and none is free, the newest running sequence not yet given tokens
   this step is preempted: by recompute (its blocks freed, its tokens prefilled again later) or,
   with `preemption_mode="swap"` and room in the host swap space, by swapping its blocks out to
   host memory. A decode with no such sequence left preempts itself; a prompt chunk waits for
   the next step instead.
3. Then swapped-out sequences are swapped back in, oldest first, while blocks allow.
4. Then waiting sequences, first come first served, while the budget and free blocks last. A
   new sequence first takes the cached blocks of its longest cached prefix (prefix caching) and
   computes only the rest (unless it asks for prompt log-probabilities, which need every prompt
   token computed); a long prompt is split into chunks across steps (chunked prefill).
Prompts share the budget (vLLM's partial-prefill limits): a prompt with more than
`long_prefill_token_threshold` tokens left to compute is long. Short waiting prompts start before
long ones, and the prompts already running leave them the tokens they need this step; at most
`max_long_partial_prefills` long prompts are left mid-prefill by a step, the others wait their
turn. So a long prompt, or a request of many, holds a short one back a step, not for its whole
prefill; a lone prompt takes the whole budget.
With the "priority" scheduling policy (vLLM's) the waiting queue is kept in (priority, arrival)
order, lower priority values first, so the steps above take the waiting ones in that order (short
before long within a priority), and preemption takes the running sequence of the lowest priority
(the latest arrival among equals) first.
With LoRA, a step takes sequences of at most `max_loras` distinct adapters (the ranks' device
slots); a sequence of another adapter waits for a later step, the others pass it.
A step that had to preempt admits nothing new (no thrashing). Writes into a block shared with a
parallel-sampling sibling copy it first (copy-on-write).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from attnserve.config import SchedulerConfig
from attnserve.engine.core.block_allocator import BlockAllocator, OutOfBlocksError
from attnserve.engine.core.priority import enqueue_by_priority, priority_order
from attnserve.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from attnserve.engine.core.sequence import Sequence, SequenceStatus, draws_of
from attnserve.step_types import SampleOutput

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: BlockAllocator,
        swap_allocator: BlockAllocator | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct LoRA adapters a step (None: LoRA off)
        self._step_loras: set[int] = set()  # the adapters of the step being scheduled
        self.allocator = allocator
        self.swap_allocator = swap_allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_steps = 0  # `schedule` calls so far

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_steps
        if self.by_priority:
            enqueue_by_priority(self.waiting, seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        """Sequences running, waiting or swapped out."""
        return bool(self.running or self.waiting or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is, freeing its device and host blocks at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if self.swap_allocator is not None and seq.swapped_blocks:
            self.swap_allocator.free(seq.swapped_blocks)
            seq.swapped_blocks = []
        seq.finish(reason)

    def abort(self, request_id: str) -> list[Sequence]:
        """End every sequence of a request; return them."""
        seqs = [
            s
            for queue in (self.running, self.waiting, self.swapped)
            for s in queue
            if s.request_id == request_id
        ]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        self._step_loras = set()
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        budget = self._schedule_running(out, budget, decodes=True)
        reserve = 0 if self.swapped else self._short_prompt_reserve(out, budget)
        budget = self._schedule_running(out, budget - reserve, decodes=False) + reserve
        if self.num_preemptions == preemptions_before:
            budget = self._swap_in(out, budget)
        if self.num_preemptions == preemptions_before and not self.swapped:
            self._admit_waiting(out, budget)
        out.scheduled.sort(key=lambda item: not item.is_prefill)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, decodes: bool) -> int:
        """Schedule the running sequences that decode (or, with `decodes` False, those in
        their prompt) within `budget`; return what is left of it."""
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._ends_when_resolved(seq):
                continue
            if (seq.num_uncomputed_tokens == 1) is not decodes or not self._lora_fits(seq):
                continue
            drafts = self._drafts(seq, budget) if decodes else []
            chunk = min(seq.num_uncomputed_tokens, budget) + len(drafts)
            if self._make_room(seq, chunk, out):
                out.scheduled.append(ScheduledSequence(seq, chunk, drafts))
                budget -= chunk
        return budget

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens > self.config.long_prefill_tokens

    def _short_prompt_reserve(self, out: SchedulerOutput, budget: int) -> int:
        """The tokens of `budget` kept from running prompts for the short waiting prompts
        that can start this step (in queue order, while sequence slots and free blocks last)."""
        reserve = blocks = 0
        slots = self.config.max_num_seqs - len(out.scheduled)
        for seq in self.waiting:
            if reserve >= budget or slots == 0:
                break
            if self._is_long(seq):
                continue
            blocks += seq.block_table.extra_blocks_for(seq.num_tokens)
            if not self.allocator.can_allocate(blocks):
                break
            reserve += seq.num_uncomputed_tokens
            slots -= 1
        return min(reserve, budget)

    def _long_prefills(self, out: SchedulerOutput) -> int:
        """Running long prompts that still have tokens to compute after this step."""
        chunks = {id(item.seq): item.num_new_tokens for item in out.scheduled}
        return sum(
            self._is_long(seq) and seq.num_uncomputed_tokens > chunks.get(id(seq), 0)
            for seq in self.running
        )

    def _ends_when_resolved(self, seq: Sequence) -> bool:
        """Whether `seq`'s pending draw (async scheduling) ends it by length whatever the token:
        a step computing the token after it would be thrown away."""
        return bool(seq.num_pending_tokens) and self._ends_by_length(seq, seq.num_pending_tokens)

    def _ends_by_length(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether `seq` has reached max_tokens or max_model_len once `ahead` more tokens are
        appended."""
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None and seq.num_output_tokens + ahead >= max_tokens:
            return True
        return len(seq.token_ids) + ahead >= self.config.max_model_len

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens `seq` carries into this step (taken from it): as many as the token
        budget and the free blocks allow beside its own token."""
        drafts, seq.spec_token_ids = seq.spec_token_ids[: budget - 1], []
        end = seq.num_computed_tokens + 1 + len(drafts)
        if drafts and not self.allocator.can_allocate(seq.block_table.extra_blocks_for(end)):
            return []
        return drafts

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter may join this step (taking a place among its adapters)."""
        if self.max_loras is None or seq.lora_request is None:
            return True
        adapter = seq.lora_request.lora_int_id
        if adapter not in self._step_loras and len(self._step_loras) >= self.max_loras:
            return False
        self._step_loras.add(adapter)
        return True

    def _room_left(self, out: SchedulerOutput, budget: int) -> bool:
        return budget > 0 and len(out.scheduled) < self.config.max_num_seqs

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and self._room_left(out, budget):
            seq = self.swapped[0]
            if not self._lora_fits(seq):
                break
            chunk = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + chunk
            if not self.allocator.can_allocate(seq.block_table.extra_blocks_for(end)):
                break
            self.swapped.popleft()
            out.swap_in += seq.block_table.swap_in(seq.swapped_blocks)
            seq.block_table.ensure_capacity(end)
            if self.swap_allocator is not None:
                self.swap_allocator.free(seq.swapped_blocks)
            seq.swapped_blocks = []
            self._start(seq, chunk, out)
            budget -= chunk
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences, the short prompts first, each group in queue order (the
        policy in the module docstring); a long one only while fewer than
        `max_long_partial_prefills` long prompts would be left mid-prefill after this step."""
        long_slots = self.config.max_long_partial_prefills - self._long_prefills(out)
        by_priority = self.by_priority
        for seq in sorted(
            self.waiting, key=lambda s: (by_priority and s.priority, self._is_long(s))
        ):
            long = self._is_long(seq)
            if not self._room_left(out, budget) or (long and long_slots <= 0):
                return
            if not self._lora_fits(seq):
                continue
            if not seq.block_table.blocks and seq.sampling_params.prompt_logprobs is None:
                # (prompt log-probabilities need every prompt token computed: no cache hits)
                seq.num_computed_tokens = seq.block_table.match_prefix(seq.token_ids)
            chunk = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + chunk
            if not self.allocator.can_allocate(seq.block_table.extra_blocks_for(end)):
                seq.reset_for_recompute()
                return
            seq.block_table.ensure_capacity(end)
            self.waiting.remove(seq)
            if not seq.first_scheduled_at:
                seq.first_scheduled_at = time.monotonic()
                seq.queued_steps = self.num_steps - seq.arrival_step
            long_slots -= long and chunk < seq.num_uncomputed_tokens
            self._start(seq, chunk, out)
            budget -= chunk

    def _start(self, seq: Sequence, chunk: int, out: SchedulerOutput) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSequence(seq, chunk))

    def _make_room(self, seq: Sequence, chunk: int, out: SchedulerOutput) -> bool:
        """Make `seq`'s next `chunk` tokens writable, preempting the newest running sequences
        not scheduled yet this step if needed (the policy in the module docstring). False when
        `seq` does not run this step."""
        start = seq.num_computed_tokens
        while True:
            try:
                out.copies += seq.block_table.prepare_write(start, start + chunk)
                return True
            except OutOfBlocksError:
                if len(self.running) == 1:
                    logger.warning("request %s outgrew the whole KV cache", seq.request_id)
                    self.finish(seq, "length")
                    out.finished.append(seq)
                    return False
                victim = self._victim(seq, out)
                if victim is None:  # a prompt chunk behind this step's decodes: next step
                    return False
                self._preempt(victim, out)
                if victim is seq:
                    return False

    def _victim(self, seq: Sequence, out: SchedulerOutput) -> Sequence | None:
        """The newest running sequence without tokens this step (by priority: the lowest one,
        `seq` included if it decodes); else `seq` itself if it decodes (or nothing else runs
        this step), else None."""
        scheduled = {id(item.seq) for item in out.scheduled}
        itself = seq.num_uncomputed_tokens == 1 or not scheduled
        others = [c for c in self.running if c is not seq and id(c) not in scheduled]
        if self.by_priority:
            return max([*others, seq] if itself else others, key=priority_order, default=None)
        return others[-1] if others else seq if itself else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        seq.spec_token_ids = []
        num_held = seq.block_table.num_held_blocks
        swap = self.swap_allocator
        if (
            self.config.preemption_mode == "swap"
            and swap is not None
            and swap.can_allocate(num_held)
        ):
            seq.swapped_blocks = swap.allocate(num_held)
            out.swap_out += zip(seq.block_table.swap_out(), seq.swapped_blocks, strict=True)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        seq.reset_for_recompute()
        if self.by_priority:
            enqueue_by_priority(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """The step's new tokens are in the cache (or on their way there): count them, register
        newly full blocks, free what window layers no longer read, and count each draw as
        pending (appended by `resolve`)."""
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted, or finished by the previous step's results
                continue
            seq.num_computed_tokens += item.num_target_tokens
            seq.block_table.commit_computed(seq.token_ids, seq.num_computed_tokens)
            if item.samples:
                seq.num_pending_tokens += 1
                seq.num_forks_pending = 0  # this step's draws include the forks' first tokens

    def resolve(
        self, out: SchedulerOutput, results: list[SampleOutput | None], eos_token_ids: list[int]
    ) -> list[Sequence]:
        """Put an advanced step's draws in place (forking where a prompt drew several tokens);
        return the sequences that got a token, finished ones included."""
        touched = []
        for item, result in zip(out.scheduled, results, strict=True):
            seq = item.seq
            if seq.is_finished or result is None:
                continue
            if result.prompt_logprobs:
                seq.prompt_logprobs += result.prompt_logprobs
            if item.spec_token_ids:
                seq.append_verified(
                    draws_of(result),
                    item.spec_token_ids,
                    lambda s: self._finish_reason(s, eos_token_ids) is not None,
                )
                seq.spec_token_ids = result.draft_token_ids or []
                touched.append(seq)
            elif result.token_ids:
                touched += self._accept(seq, result)
        for seq in touched:
            reason = self._finish_reason(seq, eos_token_ids)
            if reason is not None:
                self.finish(seq, reason)
        return touched

    def _accept(self, seq: Sequence, result: SampleOutput) -> list[Sequence]:
        draws = draws_of(result)
        seq.resolve_pending(*draws[0])
        seq.spec_token_ids = result.draft_token_ids or []
        if len(draws) == 1:
            return [seq]
        forks = [seq.fork(seq.index + i, *draw) for i, draw in enumerate(draws[1:], 1)]
        position = self.running.index(seq) + 1
        self.running[position:position] = forks
        return [seq, *forks]

    def _finish_reason(self, seq: Sequence, eos_token_ids: list[int]) -> str | None:
        params = seq.sampling_params
        token = seq.token_ids[-1]
        num_output = seq.num_output_tokens
        if num_output >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop"
            if not params.ignore_eos and token in eos_token_ids:
                return "stop"
        return "length" if self._ends_by_length(seq) else None
