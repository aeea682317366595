"""`LLMEngine`: requests in, `RequestOutput`s out, one engine-core step at a time — the front end
over an `EngineCore` (vLLM V1's split).

Here: tokenizing and checking prompts (`Processor`), detokenizing, stop strings and outputs
(`OutputProcessor`). The core (scheduler, KV blocks, executor, model) runs behind an
`EngineCoreClient`: called directly in this thread (the default for `LLM`), in a background
thread, or in a process of its own (`engine_core_process`, the default for the server; always so
with `data_parallel_size` > 1). Each `step()` takes one core step's outputs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from attnserve.config import EngineArgs
from attnserve.config.engine import EngineConfig
from attnserve.engine.core.messages import EngineCoreOutputs
from attnserve.engine.core_client import EngineCoreClient, InprocClient, ThreadClient
from attnserve.engine.output_processor import OutputProcessor, RequestState
from attnserve.engine.processor import Processor
from attnserve.engine.startup_gc import freeze_startup_objects
from attnserve.lora.request import LoRARequest
from attnserve.model.tokenizer import load_tokenizer
from attnserve.outputs import RequestOutput
from attnserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the model's half: imported only where the core runs
    from attnserve.engine.core.engine_core import EngineCore
    from attnserve.executor import ExecutorBase

logger = logging.getLogger(__name__)


def _make_client(config: EngineConfig, core_process: bool, thread_safe: bool) -> EngineCoreClient:
    """The core in its own process(es), in a background thread, or called directly."""
    if core_process and config.parallel_config.data_parallel_size > 1:
        from attnserve.engine.dp_client import DPClient

        return DPClient(config)
    if core_process:
        from attnserve.engine.proc_client import ProcClient, core_num_threads

        client = ProcClient(config, num_threads=core_num_threads(config))
        client.wait_ready()
        return client
    return ThreadClient(config) if thread_safe else InprocClient(config)


@dataclass
class StepStats:
    """The engine-core steps this front end has taken in, summed: the intervals between the
    core's hand-overs (the core's time per step) and how long each step waited before the front
    end took it (its backlog)."""

    steps: int = 0
    interval_s: float = 0.0
    backlog_s: float = 0.0
    last_handed_back: float = 0.0

    def add(self, handed_back: float, taken: float) -> None:
        if self.last_handed_back and handed_back:
            self.steps += 1
            self.interval_s += handed_back - self.last_handed_back
            self.backlog_s += max(taken - handed_back, 0.0)
        self.last_handed_back = handed_back


class LLMEngine:
    """`default_core_process`: the entry point's choice when `engine_core_process` is unset;
    `thread_safe`: callers on several threads (an in-process core then runs in a thread)."""

    def __init__(
        self, args: EngineArgs, default_core_process: bool = False, thread_safe: bool = False
    ) -> None:
        started = time.perf_counter()
        self.config = args.create_engine_config()
        self.model_config = self.config.model_config
        core_process = args.uses_core_process(default_core_process)
        self.thread_safe = thread_safe or core_process
        self.client = _make_client(self.config, core_process, thread_safe)
        try:
            self.tokenizer: PreTrainedTokenizerBase | None = (
                load_tokenizer(self.model_config) if self.model_config.tokenizer else None
            )
        except BaseException:
            self.client.shutdown()
            raise
        ready = self.client.ready
        self.processor = Processor(
            self.model_config,
            self.tokenizer,
            ready.kv_cache_tokens,
            self.config.structured_outputs_config,
            args.max_logprobs,
            self.config.lora_config,
        )
        self.output_processor = OutputProcessor()
        self.step_stats = StepStats()
        self._lock = threading.Lock()  # the output processor, for callers on several threads
        where = "in its own process" if core_process else "in this process"
        freeze_startup_objects()  # what start-up built lives as long as the engine
        logger.info("engine ready in %.1f s (core %s)", time.perf_counter() - started, where)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    @property
    def engine_core(self) -> EngineCore:
        """The core, when it runs in this process (tests, benchmarks); RuntimeError otherwise."""
        return self.client.engine_core

    @property
    def executor(self) -> ExecutorBase:
        """The core's executor (its `driver_runner` for benchmarks), in-process cores only."""
        return self.engine_core.executor

    @property
    def data_parallel_size(self) -> int:
        return self.config.parallel_config.data_parallel_size

    def shutdown(self) -> None:
        """Stop the engine core and its ranks (processes, Ray actors); idempotent."""
        self.client.shutdown()

    def check_health(self) -> None:
        """EngineDeadError when the engine core is gone."""
        self.client.check_health()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        data_parallel_rank: int | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; ValueError for a bad one. `data_parallel_rank` picks its engine
        core (default: the balancer's choice); `priority`: lower runs earlier under the
        "priority" scheduling policy (any but 0 is refused under "fcfs", as vLLM);
        `lora_request`: the LoRA adapter it runs with."""
        params = sampling_params or SamplingParams()
        policy = self.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(f"priority {priority} needs --scheduling-policy priority")
        text, token_ids = self.processor.tokenize(prompt)
        request = self.processor.process(request_id, token_ids, params, priority, lora_request)
        state = RequestState(request_id, text, token_ids, params, self.tokenizer)
        with self._lock:
            if request_id in self.output_processor:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output_processor.add_request(request.request_id, state)
        try:
            self.client.add_request(request, data_parallel_rank)
            state.submitted = time.monotonic()
        except BaseException:
            with self._lock:
                self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        """Stop a request now: no output of it comes any more; its blocks are freed by the core
        before anything sent after this (at once, with the core in this thread)."""
        with self._lock:
            core_id = self.output_processor.abort_request(request_id)
        if core_id is not None:
            self.client.abort_requests([core_id])

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def step(self) -> list[RequestOutput]:
        """The outputs of one engine-core step (waiting for it), for every request that
        advanced; nothing when no request is unfinished."""
        if not self.has_unfinished_requests():
            return []
        core_outputs = self.client.get_output()
        return self.process(core_outputs, time.monotonic())

    def process(self, core_outputs: EngineCoreOutputs, taken: float) -> list[RequestOutput]:
        """One core step's outputs (taken from the core's channel at `taken`,
        time.monotonic()) as `RequestOutput`s; the sequences a stop string ended are handed back
        to the core."""
        self.step_stats.add(core_outputs.timestamp, taken)
        with self._lock:
            processed = self.output_processor.process_outputs(core_outputs, taken)
        self.client.finish_sequences(processed.stopped)
        return processed.request_outputs

    def stats(self) -> dict[str, float]:
        """Gauges for monitoring: queue lengths, KV usage, prefix-cache hit rate (after every
        command sent before this call)."""
        return self.client.stats()

    def latest_stats(self) -> dict[str, float]:
        """The gauges the core last pushed, at once (`EngineCoreClient.latest_stats`)."""
        return self.client.latest_stats()

    def reset_stats(self) -> None:
        """Start the core's counters (prefix-cache hits, preemptions) again."""
        self.client.reset_stats()
