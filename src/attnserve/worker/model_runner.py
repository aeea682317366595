"""`ModelRunner`: turns a scheduled batch into tensors, runs the model, samples.

It loads the model, selects one attention backend for the specs of the model's attention layers
and binds it, makes one metadata builder per spec, sizes the KV cache (on CUDA, after a profile
run of the largest possible step measures its activation memory) and binds it; an fp8 cache's
scales are then calibrated on a prefill of random tokens (`kv_calibration`), and on CUDA the
longest prompts a step can hold run once (`warm_up_batches`: what their kernels compile on first
use compiles at start-up). Each step it
computes the step's `StepLayout` once (the model's positions come from it) and hands it to the
builders for the attention metadata. It never looks at the metadata or the cache layout itself.
Unless `enforce_eager`, decode-only steps replay captured graphs when the backend declares
support for them: CUDA graphs (`CUDAGraphRunner`), and on the CPU graphs of native kernel calls
for steps of up to 8 sequences (`CPUGraphRunner`); on CUDA, steps that carry prompt tokens then
replay the piecewise graphs of their token count (`PiecewiseGraphRunner`: the model between its
attention calls; attention runs eagerly) up to 2,048 tokens. `execute_async` returns without
waiting for the step's draws (a `StepFuture`); the next step may take tokens still on the device
from them (`ScheduledBatch.carried_tokens`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from itertools import accumulate, chain

import numpy as np
import torch

from attnserve.attention import (
    StepLayout,
    attention_specs,
    bind_attention_backend,
    bind_kv_caches,
    build_metadata,
    build_step_layout,
    calibrating_kv_scales,
    get_model_attn_backend,
    metadata_builders,
    set_forward_context,
)
from attnserve.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from attnserve.core import SampleOutput, ScheduledBatch, StepResults
from attnserve.distributed import get_tensor_model_parallel_world_size
from attnserve.distributed.communication import tensor_model_parallel_all_reduce_min
from attnserve.host_copy import device_tensor, to_device
from attnserve.model.config import ModelConfig
from attnserve.model.loader import load_model
from attnserve.model.sampler import Sampler, top_logprobs
from attnserve.profiling import SAMPLING_RANGE, marked
from attnserve.worker.cache_engine import (
    CacheEngine,
    gpu_kv_cache_budget,
    num_blocks_for_budget,
)
from attnserve.worker.cpu_graph import MAX_GRAPH_SEQS, CPUGraphRunner
from attnserve.worker.cuda_graph import CUDAGraphRunner
from attnserve.worker.graph_runner import GraphRunner
from attnserve.worker.kv_calibration import calibration_batch
from attnserve.worker.piecewise_graph import PiecewiseGraphRunner
from attnserve.worker.profile_run import profile_batch, warm_up_batches
from attnserve.worker.step_future import StepFuture

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        attention_backend: str | None = None,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        tp_size = get_tensor_model_parallel_world_size()  # this rank's share of the heads
        self.num_kv_heads = model_config.get_num_kv_heads(tp_size)
        self.model = load_model(
            model_config, device, cache_config.kv_cache_dtype, cache_config.block_size
        )
        specs = attention_specs(self.model)
        self.backend = get_model_attn_backend(specs, attention_backend)
        bind_attention_backend(self.model, self.backend)
        self.builders = metadata_builders(self.backend, specs, device)
        self.sampler = Sampler()
        self._last_tokens: torch.Tensor | None = None  # the last step's first draw per row
        self.graphs: GraphRunner | None = None
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
        activation_bytes = self._peak_activation_bytes(max_num_seqs, max_num_batched_tokens)
        self.cache_engine = self._allocate_kv_cache(activation_bytes)
        bind_kv_caches(self.model, self.cache_engine.kv_caches)
        self._calibrate_kv_scales(max_num_batched_tokens)
        self._warm_up(max_num_batched_tokens)
        self.graphs = None if enforce_eager else self._capture_graphs(max_num_seqs)
        self.piecewise_graphs = (
            None if self.graphs is None else self._capture_piecewise(max_num_batched_tokens)
        )

    @property
    def num_blocks(self) -> int:
        return self.cache_engine.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.cache_engine.num_swap_blocks

    def _capture_graphs(self, max_num_seqs: int) -> GraphRunner | None:
        kind: type[GraphRunner] = CUDAGraphRunner
        if self.device.type == "cpu":
            kind, max_num_seqs = CPUGraphRunner, min(max_num_seqs, MAX_GRAPH_SEQS)
        elif self.device.type != "cuda":
            return None
        if not self.backend.capabilities.graphs:
            logger.info("no graphs: backend %s does not support them", self.backend.get_name())
            return None
        max_blocks = -(-self.model_config.max_model_len // self.cache_config.block_size)
        runner = kind(self.model, self.builders, max_num_seqs, max_blocks, self.device)
        runner.capture()
        return runner

    def _capture_piecewise(self, max_num_batched_tokens: int) -> PiecewiseGraphRunner | None:
        """On CUDA, the piecewise graphs of steps that carry prompt tokens."""
        if self.device.type != "cuda":
            return None
        runner = PiecewiseGraphRunner(self.model, max_num_batched_tokens, self.device)
        try:
            runner.capture()
        except RuntimeError as error:  # a model whose forward cannot be captured: run eagerly
            torch.cuda.synchronize(self.device)
            logger.warning("no piecewise CUDA graphs (steps with prompts run eagerly): %s", error)
            return None
        return runner

    def _calibrate_kv_scales(self, max_num_batched_tokens: int) -> None:
        """An fp8 cache's scales, from one prefill of random tokens (`calibration_batch`), before
        the cache holds anything kept and before any graph is captured."""
        if self.cache_config.kv_cache_dtype != "fp8":
            return
        batch = calibration_batch(
            self.model_config.vocab_size,
            max_num_batched_tokens,
            self.model_config.max_model_len,
            self.cache_config.block_size,
            self.cache_engine.num_blocks,
        )
        with calibrating_kv_scales(self.model):
            self.execute(batch)

    def _warm_up(self, max_num_batched_tokens: int) -> None:
        """On CUDA, run the longest prompts a step can hold (`warm_up_batches`), so what their
        kernels compile on first use compiles now; the last step's draws are dropped."""
        if self.device.type != "cuda":
            return
        started = time.perf_counter()
        for batch in warm_up_batches(
            max_num_batched_tokens, self.model_config.max_model_len, self.cache_config.block_size
        ):
            self.execute(batch)
        self._last_tokens = None
        logger.info("warm-up of long prompts: %.1f s", time.perf_counter() - started)

    def profile_run(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Run the largest step the scheduler may send (`profile_batch`) against a one-block KV
        cache, which it leaves as the runner's cache: call before the real cache exists."""
        self.cache_engine = self._cache_engine(num_blocks=1, num_swap_blocks=0)
        bind_kv_caches(self.model, self.cache_engine.kv_caches)
        batch = profile_batch(
            max_num_seqs,
            max_num_batched_tokens,
            self.model_config.max_model_len,
            self.cache_config.block_size,
        )
        self.execute(batch)

    def _peak_activation_bytes(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """On CUDA, the memory the profile run takes beyond the weights at its peak (0 where the
        KV cache has a fixed budget)."""
        if self.device.type != "cuda" or self.cache_config.kv_cache_memory_bytes is not None:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_run(max_num_seqs, max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self._last_tokens = None
        torch.cuda.empty_cache()
        logger.info("profile run: %.2f GiB of activations at the largest step", peak / 2**30)
        return peak

    def _bytes_per_block(self) -> int:
        mc, cc = self.model_config, self.cache_config
        return CacheEngine.bytes_per_block(
            self.backend,
            mc.num_layers,
            self.num_kv_heads,
            mc.head_size,
            cc.block_size,
            mc.dtype,
            cc.kv_cache_dtype,
        )

    def _cache_engine(self, num_blocks: int, num_swap_blocks: int) -> CacheEngine:
        mc, cc = self.model_config, self.cache_config
        return CacheEngine(
            self.backend,
            mc.num_layers,
            self.num_kv_heads,
            mc.head_size,
            cc.block_size,
            num_blocks,
            mc.dtype,
            self.device,
            kv_cache_dtype=cc.kv_cache_dtype,
            num_swap_blocks=num_swap_blocks,
        )

    def _allocate_kv_cache(self, activation_bytes: int) -> CacheEngine:
        """The KV cache: the fixed budget if given, else on CUDA the `gpu_memory_utilization`
        share of the card less what is in use and the profile run's activations."""
        cc = self.cache_config
        per_block = self._bytes_per_block()
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = gpu_kv_cache_budget(cc.gpu_memory_utilization, self.device)
            budget -= activation_bytes
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # every rank must hold the same blocks: the smallest count any rank can afford
        num_blocks = tensor_model_parallel_all_reduce_min(num_blocks_for_budget(budget, per_block))
        tokens = num_blocks * cc.block_size
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, backend %s), up to %d tokens: "
            "%.1f requests of max_model_len %d at once",
            num_blocks,
            cc.block_size,
            num_blocks * per_block / 2**30,
            self.backend.get_name(),
            tokens,
            tokens / self.model_config.max_model_len,
            self.model_config.max_model_len,
        )
        return self._cache_engine(num_blocks, cc.swap_space_bytes // per_block)

    def _layout(self, batch: ScheduledBatch) -> StepLayout:
        seqs = batch.seqs
        return build_step_layout(
            [s.block_table for s in seqs],
            [s.context_len for s in seqs],
            [len(s.token_ids) for s in seqs],
            self.cache_config.block_size,
        )

    @staticmethod
    def _token_ids(batch: ScheduledBatch, num_tokens: int) -> torch.Tensor:
        """The step's new token ids, flat, on the host."""
        flat = chain.from_iterable(s.token_ids for s in batch.seqs)
        return torch.from_numpy(np.fromiter(flat, np.int64, num_tokens))

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        """Swaps and copy-on-write copies, before the forward pass that may reuse the blocks."""
        for pairs, move in (
            (batch.blocks_to_swap_out, self.cache_engine.swap_out),
            (batch.blocks_to_swap_in, self.cache_engine.swap_in),
            (batch.blocks_to_copy, self.cache_engine.copy),
        ):
            if pairs:
                move(torch.tensor(pairs, dtype=torch.int64))

    def execute(self, batch: ScheduledBatch) -> StepResults:
        """Run one step; return each sequence's draws (None where nothing is drawn)."""
        return self.execute_async(batch).result()

    @torch.inference_mode()
    def execute_async(self, batch: ScheduledBatch) -> StepFuture:
        """Launch one step; its draws stay on the device until the future's `result()`."""
        self._move_blocks(batch)
        layout = self._layout(batch)
        starts: list[int] = layout.query_start_loc.tolist()
        hidden = self._forward(batch, layout)
        num_seqs = len(batch.seqs)
        rows = [i for i, s in enumerate(batch.seqs) if s.sampling is not None]
        if not rows:
            results: StepResults = [None] * num_seqs
            self._add_prompt_logprobs(batch, hidden, starts, results)
            return StepFuture(num_seqs, ready=results)
        logits = self.model.compute_logits(self._last_hidden(hidden, starts, rows))
        with marked(SAMPLING_RANGE), self._sampling_threads():
            draw = self.sampler.draw(logits, [batch.seqs[i] for i in rows], batch.token_bitmask)
        tokens = draw.tokens
        one_draw_each = len(tokens) == len(rows)
        self._last_tokens = tokens if one_draw_each else tokens[self._first_draws(draw.counts)]
        needs_host = draw.top is not None or any(s.prompt_logprob_targets for s in batch.seqs)
        if one_draw_each and not needs_host:
            return StepFuture(num_seqs, (rows, tokens, draw.token_logprobs))
        results = [None] * num_seqs
        drawn = self.sampler.split(
            tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts
        )
        for row, result in zip(rows, drawn, strict=True):
            results[row] = result
        self._add_prompt_logprobs(batch, hidden, starts, results)
        return StepFuture(num_seqs, ready=results)

    @contextlib.contextmanager
    def _sampling_threads(self) -> Iterator[None]:
        """On the CPU, the sampler's ops on one thread: splitting a [rows, vocab] reduction
        over torch's OpenMP threads gains little and, where another process holds a core,
        waits for the descheduled thread at every op (milliseconds a step instead of tens of
        microseconds)."""
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @torch.inference_mode()
    def final_hidden_states(self, batch: ScheduledBatch) -> torch.Tensor:
        """Every new token's final hidden states [T, hidden] (after the model's last norm; its
        `compute_logits` gives the logits), nothing sampled: for measuring how close two
        configurations of one model run (`attnserve bench kv-quality`)."""
        self._move_blocks(batch)
        return self._forward(batch, self._layout(batch))

    def _first_draws(self, counts: list[int]) -> torch.Tensor:
        return device_tensor([0, *accumulate(counts)][:-1], self.device)

    def _carried(
        self, batch: ScheduledBatch, last_token: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the batch's carried tokens go in the flat token ids (`last_token[row]` is the
        index of row's last new token), and their values, taken from the last step's draws."""
        if self._last_tokens is None:
            raise RuntimeError("carried tokens, but no step has drawn tokens yet")
        index = [last_token[row] for row, _ in batch.carried_tokens]
        draws = [draw for _, draw in batch.carried_tokens]
        return (
            device_tensor(index, self.device),
            self._last_tokens[device_tensor(draws, self.device)],
        )

    def _last_hidden(
        self, hidden: torch.Tensor, starts: list[int], rows: list[int]
    ) -> torch.Tensor:
        """The hidden states of the last new token of each sequence in `rows`."""
        if len(rows) == len(hidden):  # one token per sequence, each sampling (a decode step)
            return hidden
        last = device_tensor([starts[i + 1] - 1 for i in rows], self.device)
        return hidden[last]

    def _forward(self, batch: ScheduledBatch, layout: StepLayout) -> torch.Tensor:
        """Final hidden states of the step's new tokens (sequence i's at query_start_loc[i] ..
        query_start_loc[i + 1] - 1), from graphs when they fit: a decode step's whole graph,
        or a step with prompts from the piecewise graphs of its token count."""
        token_ids = self._token_ids(batch, int(layout.query_start_loc[-1]))
        graphs, pieces = self.graphs, self.piecewise_graphs
        if (
            graphs is not None
            and layout.num_prefills == 0
            and layout.num_seqs <= graphs.max_num_seqs
        ):
            carried = None
            if batch.carried_tokens:
                carried = self._carried(batch, range(layout.num_seqs))
            return graphs.run(token_ids, layout, carried)
        last_token = (layout.query_start_loc[1:] - 1).tolist() if batch.carried_tokens else []
        metadata = build_metadata(self.builders, layout)
        if pieces is not None and len(token_ids) <= pieces.max_num_tokens:
            carried = self._carried(batch, last_token) if batch.carried_tokens else None
            return pieces.run(token_ids, layout.token_pos, metadata, carried)
        input_ids = to_device(token_ids, self.device)
        positions = to_device(layout.token_pos, self.device)
        if batch.carried_tokens:
            index, values = self._carried(batch, last_token)
            input_ids[index] = values
        with set_forward_context(metadata):
            hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def _add_prompt_logprobs(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor,
        starts: list[int],
        results: list[SampleOutput | None],
    ) -> None:
        for i, seq in enumerate(batch.seqs):
            targets = seq.prompt_logprob_targets
            if not targets:
                continue
            rows = hidden[starts[i] : starts[i] + len(targets)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            chosen = device_tensor(targets, self.device)
            entries = top_logprobs(logprobs, chosen, [seq.num_prompt_logprobs] * len(targets))
            previous = results[i] or SampleOutput([])
            results[i] = dataclasses.replace(previous, prompt_logprobs=entries)
