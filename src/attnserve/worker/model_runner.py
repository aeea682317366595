"""`ModelRunner`: one rank's model, KV cache and persistent batch; runs each step's plan.

The worker sets it up in explicit phases, in order: `load_model` (the model, its layers'
KV-cache groups, one attention backend selected for their specs and bound, one metadata builder
per spec), `profile_activation_memory` (on CUDA, a profile run of the largest possible step
measures its activations), `initialize_kv_cache` (sized from what is left, bound to the layers),
`calibrate_kv_scales` (an fp8 cache's scales, from a prefill of random tokens: `kv_calibration`),
`warm_up` (on CUDA the longest prompts a step can hold run once: what their kernels compile on
first use compiles at start-up) and `capture_graphs` (`worker.graphs`: decode-only steps replay
whole-model graphs, on CUDA and, up to 8 sequences, on the CPU; on CUDA steps that carry prompt
tokens, up to 2,048, replay the piecewise graphs of their token count).

A step (`execute_async`) reads top to bottom: `prepare` applies the plan to its `InputBatch`
(what changed since the last one), which gives the step's `StepLayout` (the model's positions
come from it; the builders make the attention metadata from it), token ids and sampling rows;
`forward` runs the model (from graphs where they fit); `StepSampling.sample` draws (or
verifies drafts); `StepSampling.commit` takes the draws into the batch, once
(`InputBatch.commit`). It never looks at the metadata or the cache layout itself.
`execute_async` returns without waiting for the step's draws (a `StepFuture`); the next step
takes the tokens it needs from them on the device. A step may also be launched in two halves:
`launch_forward` prepares and runs the forward pass and returns a `ForwardPass`, whose `sample`
takes the token bitmask computed meanwhile, then samples and commits
(`worker/step_sampling.py`).
"""

from __future__ import annotations

import logging
import time

import torch

from attnserve.attention import (
    attention_specs,
    bind_attention_backend,
    build_metadata,
    calibrating_kv_scales,
    get_model_attn_backend,
    kv_scales_from_checkpoint,
    metadata_builders,
    set_forward_context,
)
from attnserve.attention.kv_cache_groups import (
    assign_kv_cache_groups,
    bind_group_caches,
    num_cache_tensors,
)
from attnserve.config import DEFAULT_CPU_KV_CACHE_BYTES
from attnserve.config.engine import EngineConfig
from attnserve.distributed import get_tensor_model_parallel_world_size
from attnserve.distributed.communication import tensor_model_parallel_all_reduce_min
from attnserve.host_copy import to_device
from attnserve.lora.manager import LoRAModelManager
from attnserve.model.loader import load_model
from attnserve.step_types import SampleOutput, StepPlan, StepResults
from attnserve.worker.cache_engine import CacheEngine, gpu_kv_cache_budget, num_blocks_for_budget
from attnserve.worker.graphs import (
    GraphRunner,
    PiecewiseGraphRunner,
    capture_decode_graphs,
    capture_piecewise_graphs,
)
from attnserve.worker.input_batch import InputBatch, PreparedStep
from attnserve.worker.kv_calibration import calibration_plan
from attnserve.worker.profile_run import profile_plan, warm_up_plans
from attnserve.worker.sampler import Sampler
from attnserve.worker.step_future import StepFuture
from attnserve.worker.step_sampling import ForwardPass, StepSampling, last_hidden

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.attention_backend = config.attention_backend
        self.lora_config = config.lora_config
        self.lora: LoRAModelManager | None = None  # the adapters, with LoRA on
        self.device = device
        self.num_kv_heads = self.model_config.get_num_kv_heads(
            get_tensor_model_parallel_world_size()  # this rank's share of the heads
        )
        self.input_batch = InputBatch(
            self.model_config.max_model_len,
            self.cache_config.block_size,
            list(self.model_config.eos_token_ids),
            device,
        )
        self.sampler = Sampler()
        self.graphs: GraphRunner | None = None
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
        self._unsampled: ForwardPass | None = None  # the last step launched in two halves

    def load_model(self) -> None:
        """Load the weights, select and bind the attention backend, make the builders."""
        self.model = load_model(
            self.model_config, self.device, self.cache_config.kv_cache_dtype, self.block_size
        )
        hybrid = not self.cache_config.disable_hybrid_kv_cache_manager
        self.kv_cache_groups = assign_kv_cache_groups(self.model, hybrid)
        self.input_batch.set_kv_cache_groups(len(self.kv_cache_groups))
        specs = attention_specs(self.model)
        self.backend = get_model_attn_backend(specs, self.attention_backend)
        bind_attention_backend(self.model, self.backend)
        self.builders = metadata_builders(self.backend, specs, self.device)
        if self.lora_config is not None:
            self.lora = LoRAModelManager.for_model(
                self.model, self.lora_config, self.model_config, self.max_num_batched_tokens
            )
        self.sampling = StepSampling(
            self.model.compute_logits, self.sampler, self.input_batch, self.device
        )

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    @property
    def num_blocks(self) -> int:
        return self.cache_engine.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.cache_engine.num_swap_blocks

    @property
    def kv_cache_windows(self) -> list[int | None]:
        return [group.sliding_window for group in self.kv_cache_groups]

    def profile_activation_memory(self) -> int:
        """On CUDA, the memory the profile run takes beyond the weights at its peak (0 where the
        KV cache has a fixed budget, or off CUDA)."""
        if self.device.type != "cuda" or self.cache_config.kv_cache_memory_bytes is not None:
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_run(self.max_num_seqs, self.max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        logger.info("profile run: %.2f GiB of activations at the largest step", peak / 2**30)
        return peak

    def profile_run(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Run the largest step the scheduler may send (`profile_plan`) against a one-block KV
        cache, which it leaves as the runner's cache: call before the real cache exists."""
        self._bind_cache(self._cache_engine(num_blocks=1, num_swap_blocks=0))
        plan = profile_plan(
            max_num_seqs, max_num_batched_tokens, self.model_config.max_model_len, self.block_size
        )
        self.run_once(plan)

    def initialize_kv_cache(self, activation_bytes: int, shared_bytes_per_block: int = 0) -> None:
        """The KV cache: the fixed budget if given, else on CUDA the `gpu_memory_utilization`
        share of the card less what is in use and the profile run's `activation_bytes`; each
        block also pays `shared_bytes_per_block` (a draft model's cache of as many blocks)."""
        cc = self.cache_config
        per_block = self.bytes_per_block() + shared_bytes_per_block
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = gpu_kv_cache_budget(cc.gpu_memory_utilization, self.device) - activation_bytes
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # every rank must hold the same blocks: the smallest count any rank can afford
        num_blocks = tensor_model_parallel_all_reduce_min(num_blocks_for_budget(budget, per_block))
        tokens = num_blocks * cc.block_size
        max_model_len = self.model_config.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, backend %s), up to %d tokens: "
            "%.1f requests of max_model_len %d at once",
            num_blocks,
            cc.block_size,
            num_blocks * per_block / 2**30,
            self.backend.get_name(),
            tokens,
            tokens / max_model_len,
            max_model_len,
        )
        self._bind_cache(self._cache_engine(num_blocks, cc.swap_space_bytes // per_block))

    def initialize_kv_cache_of(self, num_blocks: int, num_swap_blocks: int) -> None:
        """A KV cache of exactly these block counts (a draft model's, beside the target's)."""
        self._bind_cache(self._cache_engine(num_blocks, num_swap_blocks))

    def _bind_cache(self, cache_engine: CacheEngine) -> None:
        self.cache_engine = cache_engine
        bind_group_caches(self.model, self.kv_cache_groups, cache_engine.kv_caches)

    def bytes_per_block(self) -> int:
        mc, cc = self.model_config, self.cache_config
        return CacheEngine.bytes_per_block(
            self.backend,
            num_cache_tensors(self.kv_cache_groups),
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
            num_cache_tensors(self.kv_cache_groups),
            self.num_kv_heads,
            mc.head_size,
            cc.block_size,
            num_blocks,
            mc.dtype,
            self.device,
            kv_cache_dtype=cc.kv_cache_dtype,
            num_swap_blocks=num_swap_blocks,
        )

    def calibrate_kv_scales(self) -> None:
        """An fp8 cache's scales, from one prefill of random tokens (`calibration_plan`), before
        the cache holds anything kept and before any graph is captured; none where the
        checkpoint gave them."""
        if self.cache_config.kv_cache_dtype != "fp8":
            return
        if kv_scales_from_checkpoint(self.model):
            logger.info("fp8 KV cache: the checkpoint's k_scale / v_scale, no calibration")
            return
        plan = calibration_plan(
            self.model_config.vocab_size,
            self.max_num_batched_tokens,
            self.model_config.max_model_len,
            self.block_size,
            self.cache_engine.num_blocks,
        )
        with calibrating_kv_scales(self.model):
            self.run_once(plan)

    def warm_up(self) -> None:
        """On CUDA, run the longest prompts a step can hold (`warm_up_plans`), so what their
        kernels compile on first use compiles now."""
        if self.device.type != "cuda":
            return
        started = time.perf_counter()
        max_model_len = self.model_config.max_model_len
        for plan in warm_up_plans(self.max_num_batched_tokens, max_model_len, self.block_size):
            self.run_once(plan)
        logger.info("warm-up of long prompts: %.1f s", time.perf_counter() - started)

    def capture_graphs(self) -> None:
        """The decode graphs, then on CUDA the piecewise graphs of steps with prompts
        (`worker.graphs`). None on the CPU with LoRA: CPU graphs record only native calls."""
        if self.lora is not None and self.device.type == "cpu":
            return
        self.graphs = capture_decode_graphs(
            self.model,
            self.backend,
            self.builders,
            self.max_num_seqs,
            self.input_batch.max_blocks,
            self.device,
        )
        if self.graphs is not None and self.device.type == "cuda":
            self.piecewise_graphs = capture_piecewise_graphs(
                self.model, self.max_num_batched_tokens, self.device
            )

    def run_once(self, plan: StepPlan) -> StepResults:
        """Run a plan of new sequences only (start-up runs, benchmarks), then drop them."""
        try:
            return self.execute(plan)
        finally:
            self.input_batch.release([seq.seq_id for seq in plan.new_seqs])

    def execute(self, plan: StepPlan) -> StepResults:
        """Run one step; return each sequence's draws (None where nothing is drawn)."""
        return self.execute_async(plan).result()

    @torch.inference_mode()
    def execute_async(self, plan: StepPlan) -> StepFuture:
        """One step, top to bottom: its inputs (`prepare`), the model's pass (`forward`), its
        draws under the plan's token bitmask (`StepSampling.sample`), their one commit into the
        batch (`StepSampling.commit`). The draws stay on the device until the future's
        `result()`."""
        step = self.prepare(plan)
        hidden = self.forward(step)
        draws = self.sampling.sample(step, hidden, plan.token_bitmask)
        return self.sampling.commit(step, draws)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> ForwardPass:
        """`execute_async` in two halves: prepare and forward now, sample and commit in the
        pass's `sample`, which takes the step's token bitmask (computed meanwhile). No other
        step is launched before."""
        step = self.prepare(plan)
        self._unsampled = ForwardPass(self.sampling, step, self.forward(step))
        return self._unsampled

    def prepare(self, plan: StepPlan, decode_rows_up_to: int = 1) -> PreparedStep:
        """The plan applied (`apply_plan`), then the step's inputs from the batch."""
        if self._unsampled is not None and not self._unsampled.sampled:
            raise RuntimeError("a step was launched before the step before it was sampled")
        self.apply_plan(plan)
        if self.lora is not None:
            self.lora.prepare(plan)
        return self.input_batch.prepare(plan, decode_rows_up_to)

    def apply_plan(self, plan: StepPlan) -> None:
        """Block moves first (swaps, copy-on-write copies: the forward pass may reuse the
        blocks), then the plan applied to the persistent batch; nothing computed."""
        for pairs, move in (
            (plan.blocks_to_swap_out, self.cache_engine.swap_out),
            (plan.blocks_to_swap_in, self.cache_engine.swap_in),
            (plan.blocks_to_copy, self.cache_engine.copy),
        ):
            if pairs:
                move(torch.tensor(pairs, dtype=torch.int64))
        self.input_batch.apply(plan)

    @torch.inference_mode()
    def draft_step(self, plan: StepPlan, draw: bool, decode_rows_up_to: int) -> list[int]:
        """A draft model's pass (`DraftModelProposer`): `plan` run and committed, a pass of at
        most `decode_rows_up_to` tokens a sequence as decode rows; with `draw`, each sequence's
        greedy next token, taken in and returned."""
        step = self.prepare(plan, decode_rows_up_to)
        hidden = self.forward(step)
        if not draw:
            self.input_batch.commit(step, None, None)
            return []
        logits = self.model.compute_logits(last_hidden(hidden, step))
        drawn: list[int] = logits.argmax(dim=-1).tolist()
        self.input_batch.commit(step, None, [SampleOutput([token]) for token in drawn])
        return drawn

    @torch.inference_mode()
    def final_hidden_states(self, plan: StepPlan) -> torch.Tensor:
        """Every new token's final hidden states [T, hidden] (after the model's last norm; its
        `compute_logits` gives the logits) of a plan of new sequences, nothing sampled, the
        sequences dropped after: for measuring how close two configurations of one model run
        (`attnserve bench kv-quality`)."""
        try:
            return self.forward(self.prepare(plan))
        finally:
            self.input_batch.release([seq.seq_id for seq in plan.new_seqs])

    def forward(self, step: PreparedStep) -> torch.Tensor:
        """Final hidden states of the step's new tokens (sequence i's at query_start_loc[i] ..
        query_start_loc[i + 1] - 1), from graphs when they fit: a decode step's whole graph,
        or a step with prompts from the piecewise graphs of its token count."""
        layout, token_ids, carried = step.layout, step.token_ids, step.carried
        graphs, pieces = self.graphs, self.piecewise_graphs
        if (
            graphs is not None
            and layout.num_prefills == 0
            and layout.num_seqs <= graphs.max_num_seqs
        ):
            return graphs.run(token_ids, layout, carried)
        metadata = build_metadata(self.builders, layout)
        if pieces is not None and len(token_ids) <= pieces.max_num_tokens:
            return pieces.run(token_ids, layout.token_pos, metadata, carried)
        input_ids = to_device(token_ids, self.device)
        positions = to_device(layout.token_pos, self.device)
        if carried is not None:
            input_ids[carried[0]] = carried[1]
        with set_forward_context(metadata):
            hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden
