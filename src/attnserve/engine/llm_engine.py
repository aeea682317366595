"""`LLMEngine`: requests in, `RequestOutput`s out, one scheduled step at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from attnserve.core import AsyncStepOutput
from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.block_allocator import BlockAllocator
from attnserve.engine.block_table import BlockTable
from attnserve.engine.request import Request
from attnserve.engine.scheduler import Scheduler, SchedulerOutput
from attnserve.engine.sequence import Sequence
from attnserve.engine.step_inputs import build_batch
from attnserve.executor import get_executor_class
from attnserve.model.tokenizer import load_tokenizer
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LaunchedStep:
    scheduled: SchedulerOutput
    future: AsyncStepOutput
    draw_index: dict[int, int]  # id(sequence) -> its (first) draw's index among the step's draws


def _needs_host_tokens(scheduled: SchedulerOutput) -> bool:
    """Whether a step needs every drawn token on the host first (penalties read the outputs)."""
    return any(i.samples and i.seq.sampling_params.has_penalties for i in scheduled.scheduled)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        started = time.perf_counter()
        self.config = args.create_engine_config()
        self.model_config = self.config.model_config
        cache_config = self.config.cache_config
        scheduler_config = self.config.scheduler_config
        parallel_config = self.config.parallel_config
        torch.manual_seed(self.config.seed)
        self.tokenizer: PreTrainedTokenizerBase | None = (
            load_tokenizer(self.model_config) if self.model_config.tokenizer else None
        )
        self.executor = get_executor_class(parallel_config)(self.config)
        self.block_size = cache_config.block_size
        num_blocks = self.executor.num_blocks
        self.allocator = BlockAllocator(num_blocks, cache_config.enable_prefix_caching)
        swap_blocks = self.executor.num_swap_blocks
        self.scheduler = Scheduler(
            scheduler_config,
            self.allocator,
            BlockAllocator(swap_blocks) if swap_blocks else None,
        )
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._in_flight: _LaunchedStep | None = None
        # Several ranks run each step synchronously: nothing to overlap, so no lookahead.
        self.async_scheduling = (
            scheduler_config.async_scheduling and parallel_config.world_size == 1
        )
        logger.info("engine ready in %.1f s", time.perf_counter() - started)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def shutdown(self) -> None:
        """Stop the executor's ranks (worker processes, Ray actors); idempotent."""
        self.executor.shutdown()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self._check_prompt(token_ids)
        seq = Sequence(request_id, token_ids, params, BlockTable(self.allocator, self.block_size))
        self.requests[request_id] = Request(request_id, text, seq, self.tokenizer)
        self.scheduler.add(seq)

    def _check_prompt(self, token_ids: list[int]) -> None:
        max_len = self.model_config.max_model_len
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room under max_model_len {max_len}"
            )
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        capacity = self.allocator.num_blocks * self.block_size
        if len(token_ids) + 1 > capacity:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens does not fit the KV cache ({capacity} tokens)"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; every block it held is free when this returns."""
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; outputs for every request that advanced.

        With async scheduling the step launched here is read back during the next call (its
        tokens meanwhile feed the next step on the device), so the host's work for one step
        overlaps the device's work for the previous one; each call returns the outputs of the
        step launched by the call before.
        """
        scheduled = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and _needs_host_tokens(scheduled):
            outputs += self._drain()
            scheduled.scheduled = [i for i in scheduled.scheduled if not i.seq.is_finished]
        if not scheduled.scheduled:
            return outputs + self._drain()
        launched = self._launch(scheduled)
        outputs += self._drain()
        self.scheduler.advance(scheduled)
        self._in_flight = launched
        if not self.async_scheduling:
            outputs += self._drain()
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Read back the step in flight, if there is one."""
        launched, self._in_flight = self._in_flight, None
        return [] if launched is None else self._finish(launched)

    def _launch(self, scheduled: SchedulerOutput) -> _LaunchedStep:
        draws = self._in_flight.draw_index if self._in_flight is not None else {}
        carried = [
            (row, draws[id(item.seq)])
            for row, item in enumerate(scheduled.scheduled)
            if item.samples and item.seq.has_pending_token
        ]
        batch = build_batch(scheduled, self.eos_token_ids, carried)
        sampling = (item.seq for item in scheduled.scheduled if item.samples)
        draw_index = {id(seq): j for j, seq in enumerate(sampling)}
        return _LaunchedStep(scheduled, self.executor.execute_model_async(batch), draw_index)

    def _finish(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's draws back and turn them into outputs."""
        touched = self.scheduler.resolve(
            launched.scheduled, launched.future.result(), self.eos_token_ids
        )
        advanced: dict[str, Request] = {}
        for seq in touched:
            request = self.requests[seq.request_id]
            if request.observe(seq) and not seq.is_finished:
                self.scheduler.finish(seq, "stop")  # the text is already cut at the stop
            if seq.is_finished or not request.final_only:  # else it has nothing to say yet
                advanced[seq.request_id] = request
        outputs = []
        for request_id, request in advanced.items():
            output = request.output()
            if output is not None:
                outputs.append(output)
            if request.finished:
                del self.requests[request_id]
        return outputs

    def stats(self) -> dict[str, float]:
        """Gauges for monitoring: queue lengths, KV usage, prefix-cache hit rate."""
        used = self.allocator.num_blocks - self.allocator.num_free_blocks
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "kv_cache_usage": used / self.allocator.num_blocks,
            "prefix_cache_hit_rate": self.allocator.prefix_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
        }
