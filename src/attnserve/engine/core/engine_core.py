"""`EngineCore`: the scheduler, the KV block pool and the executor — `EngineCoreRequest`s in, one
`EngineCoreOutputs` out per step (vLLM V1's EngineCore).

It knows token ids only: no tokenizer, no text, no stop strings (the front end's
`OutputProcessor` turns its outputs into `RequestOutput`s and tells it, through
`finish_sequences`, which sequences a stop string ended). It runs in the front end's process
(`InprocClient`), in a thread of it, or in a process of its own (`core_process`), unchanged.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from attnserve.config.engine import EngineConfig
from attnserve.engine.core.block_allocator import BlockAllocator
from attnserve.engine.core.block_table import BlockTable, max_sequence_tokens
from attnserve.engine.core.constrained_decoding import StructuredOutputManager
from attnserve.engine.core.messages import (
    CoreReady,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from attnserve.engine.core.scheduler import Scheduler, SchedulerOutput
from attnserve.engine.core.sequence import Sequence
from attnserve.engine.core.speculator import Speculator
from attnserve.engine.core.step_pipeline import StepPipeline
from attnserve.executor import get_executor_class
from attnserve.spec_decode.metrics import SpecDecodeStats

logger = logging.getLogger(__name__)


def _needs_host_tokens(scheduled: SchedulerOutput) -> bool:
    """Whether a step needs every drawn token on the host before it is launched: penalties
    read the outputs. (A grammar's bitmask follows them too, but is needed only at sampling
    time: the pipeline launches such a step's forward pass first and its draws after.)"""
    return any(i.samples and i.seq.sampling_params.has_penalties for i in scheduled.scheduled)


def _outputs(seq: Sequence, drew: bool) -> list[EngineCoreOutput]:
    """What `seq` got this step: its new token if it `drew` (none when the scheduler ended
    it) — with speculation, one output per token it appended (the drafts accepted and one
    more), each with the cumulative log-probability up to it, so the front end meets a stop
    string at the token that completes it, as without speculation; for a request that needs
    its outputs only when finished, nothing until then, and then all of it."""
    params = seq.sampling_params
    if params.outputs_only_when_finished:
        return [_whole_output(seq)] if seq.is_finished else []
    if not drew:
        return [EngineCoreOutput(seq.request_id, seq.index, [], finish_reason=seq.finish_reason)]
    new = seq.num_step_tokens
    first_output = seq.num_output_tokens - new + 1
    outputs = []
    for j in range(-new, 0):
        first = seq.index == 0 and first_output == 1 and j == -new
        outputs.append(
            EngineCoreOutput(
                seq.request_id,
                seq.index,
                [seq.token_ids[j]],
                [seq.logprobs[j]] if params.logprobs is not None else None,
                seq.step_cumulative_logprobs[j],
                seq.finish_reason if j == -1 else None,
                seq.prompt_logprobs if first and params.prompt_logprobs is not None else None,
                seq.first_scheduled_at if first else None,
                seq.queued_steps if first else None,
            )
        )
    return outputs


def _whole_output(seq: Sequence) -> EngineCoreOutput:
    params = seq.sampling_params
    return EngineCoreOutput(
        seq.request_id,
        seq.index,
        seq.output_token_ids,
        list(seq.logprobs) if params.logprobs is not None else None,
        seq.cumulative_logprob,
        seq.finish_reason,
        seq.prompt_logprobs if seq.index == 0 and params.prompt_logprobs is not None else None,
    )


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        cache_config = config.cache_config
        scheduler_config = config.scheduler_config
        parallel_config = config.parallel_config
        torch.manual_seed(config.seed)
        self.executor = get_executor_class(parallel_config)(config)
        self.block_size = cache_config.block_size
        kv_cache = self.executor.kv_cache_info
        self.kv_cache_windows = kv_cache.windows
        self.allocator = BlockAllocator(kv_cache.num_blocks, cache_config.enable_prefix_caching)
        swap_blocks = kv_cache.num_swap_blocks
        self.scheduler = Scheduler(
            scheduler_config,
            self.allocator,
            BlockAllocator(swap_blocks) if swap_blocks else None,
            max_loras=None if config.lora_config is None else config.lora_config.max_loras,
        )
        self.eos_token_ids = list(config.model_config.eos_token_ids)
        # the rank runs in this process on CUDA: token bitmasks in pinned memory (async copies)
        pinned = config.device.type == "cuda" and parallel_config.executor_backend == "uni"
        self.structured_outputs = StructuredOutputManager(
            config.model_config, pinned, config.structured_outputs_config
        )
        self.requests: dict[str, dict[int, Sequence]] = {}  # request id -> index -> sequence
        self._ended: list[str] = []  # requests ended since the last report
        spec = config.speculative_config
        self.pipeline = StepPipeline(
            self.executor,
            self.scheduler,
            self.structured_outputs,
            self.eos_token_ids,
            None if spec is None else SpecDecodeStats(),
        )
        self.num_requests_added = 0
        self.num_steps = 0
        # Several ranks run each step synchronously: nothing to overlap, so no lookahead.
        self.async_scheduling = (
            scheduler_config.async_scheduling and parallel_config.world_size == 1
        )
        self.speculator = None if spec is None else Speculator(spec, scheduler_config.max_model_len)
        logger.info("engine core ready in %.1f s", time.perf_counter() - started)

    def ready_message(self) -> CoreReady:
        tokens = max_sequence_tokens(
            self.allocator.num_blocks,
            self.block_size,
            self.kv_cache_windows,
            self.config.scheduler_config.max_num_batched_tokens,
        )
        return CoreReady(tokens, os.getpid())

    def shutdown(self) -> None:
        """Stop the executor's ranks (worker processes, Ray actors); idempotent."""
        self.executor.shutdown()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has checked (ids unique, prompt in range)."""
        lora_id = request.lora_request.lora_int_id if request.lora_request is not None else 0
        block_table = BlockTable(
            self.allocator, self.block_size, self.kv_cache_windows, lora_int_id=lora_id
        )
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            block_table,
            priority=request.priority,
        )
        seq.lora_request = request.lora_request
        self.requests[request.request_id] = {0: seq}
        self.num_requests_added += 1
        spec = request.sampling_params.structured_outputs
        if spec is None:
            self.scheduler.add(seq)
        else:  # scheduled once its grammar is compiled
            self.structured_outputs.submit(seq, spec)

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests now; every block they held is free when this returns."""
        for request_id in request_ids:
            self.scheduler.abort(request_id)
            self.requests.pop(request_id, None)

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """End the sequences (request id, index) whose text reached a stop string."""
        for request_id, index in sequences:
            seqs = self.requests.get(request_id, {})
            seq = seqs.get(index)
            if seq is None or seq.is_finished:
                continue
            self.scheduler.finish(seq, "stop")
            if all(s.is_finished for s in seqs.values()):
                self._end(request_id)

    def _end(self, request_id: str) -> None:
        del self.requests[request_id]
        self._ended.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run, or ended ones not reported yet."""
        return bool(self.requests or self._ended)

    def step(self) -> EngineCoreOutputs:
        """Schedule and launch one step; the outputs of every sequence that advanced.

        With async scheduling the step launched here is read back during the next call (its
        tokens meanwhile feed the next step on the device), so the host's work for one step
        overlaps the device's work for the previous one; each call reports the step launched by
        the call before. A step with constrained draws overlaps too: its forward pass is launched
        before the previous step is read back, its token bitmask (which follows that step's
        tokens) handed over after (`StepPipeline.launch`). While speculative decoding is active
        (a small batch), each step is read back at once, with the drafts the ranks proposed for
        the next step, of which each running sequence keeps those that fit.
        """
        self.num_steps += 1
        out = EngineCoreOutputs()
        self._admit_compiled(out)
        scheduled = self.scheduler.schedule()
        speculator = self.speculator
        speculating = speculator is not None and speculator.pace(
            scheduled, self.scheduler.running, self.num_steps
        )
        self._report(scheduled.finished, out, drew=False)
        if self.pipeline.busy and _needs_host_tokens(scheduled):
            self._report(self.pipeline.drain(), out, drew=True)
            scheduled.scheduled = [i for i in scheduled.scheduled if not i.seq.is_finished]
        if scheduled.scheduled:
            self._report(self.pipeline.launch(scheduled), out, drew=True)
        if not self.async_scheduling or not scheduled.scheduled or speculating:
            self._report(self.pipeline.drain(), out, drew=True)
        out.drawn_at = time.monotonic()
        if speculating and speculator is not None:
            speculator.take_drafts(self.scheduler.running, self.num_steps)
        out.finished_requests, self._ended = self._ended, []
        out.timestamp = time.monotonic()
        return out

    def _admit_compiled(self, out: EngineCoreOutputs) -> None:
        """Schedule the constrained requests whose grammar is compiled (waiting for one when
        nothing else is to be done)."""
        idle = not self.pipeline.busy and not self.scheduler.has_work()
        for seq in self.structured_outputs.take_ready(block=idle):
            if seq.request_id not in self.requests:  # aborted while it compiled
                continue
            if seq.is_finished:
                self._report([seq], out, drew=False)
            else:
                self.scheduler.add(seq)

    def _report(self, seqs: list[Sequence], out: EngineCoreOutputs, drew: bool) -> None:
        """Each sequence's output (forks join their request here); then end every request
        whose sequences have all finished."""
        for seq in seqs:
            out.outputs += _outputs(seq, drew)
            self.requests[seq.request_id].setdefault(seq.index, seq)
        for seq in seqs:
            request = self.requests.get(seq.request_id) if seq.is_finished else None
            if request is not None and all(s.is_finished for s in request.values()):
                self._end(seq.request_id)

    def reset_stats(self) -> None:
        """Start the counters behind `stats` again (prefix-cache hits, preemptions): what a
        server's warm-up did is no client's."""
        self.allocator.prefix_queries = self.allocator.prefix_hits = 0
        self.scheduler.num_preemptions = 0
        if self.pipeline.spec_stats is not None:
            self.pipeline.spec_stats = SpecDecodeStats()

    def stats(self) -> dict[str, float]:
        """Gauges for monitoring: queue lengths, KV usage, prefix-cache hit rate; with
        speculative decoding, its counts (`SpecDecodeStats.as_dict`)."""
        used = self.allocator.num_blocks - self.allocator.num_free_blocks
        spec_stats = self.pipeline.spec_stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + self.structured_outputs.num_compiling,
            "num_swapped": len(self.scheduler.swapped),
            "kv_cache_usage": used / self.allocator.num_blocks,
            "prefix_cache_hit_rate": self.allocator.prefix_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_added": self.num_requests_added,
            "num_steps": self.num_steps,
            **(spec_stats.as_dict() if spec_stats is not None else {}),
        }
