"""`Worker`: one tensor-parallel rank — its device, its place in the process group, its
`ModelRunner` — and the step protocol between the ranks. Every rank receives the engine's one
`EngineConfig`.

The worker sets its model runner up phase by phase (`load_model`). The driver (rank 0)
broadcasts each step's `StepPlan` (only what changed since the last one) once over the CPU group
and runs it; every other rank sits in `execute_model_loop`, applying each plan it receives to
its own persistent batch and running it, until the driver broadcasts None. All ranks sample (the
logits are all-gathered, the draws the same on every rank), so each rank's batch knows the tokens
its next step reads; only the driver's results are returned. With speculative decoding each rank
also holds a `Proposer` (`spec_decode`), which after a step sets the next step's drafts of the
sequences the plan drafts for on their results (a draft model's also takes in every step). A
single rank (in the engine's process) also runs a step in two halves (`launch_forward`): the
forward pass at once, the draws when the engine hands over the token bitmask it computed
meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from attnserve.config.cache import KVCacheInfo
from attnserve.config.engine import EngineConfig
from attnserve.distributed import (
    broadcast_object,
    destroy_distributed_environment,
    init_distributed_environment,
)
from attnserve.spec_decode.draft_model_proposer import DraftModelProposer
from attnserve.spec_decode.ngram_proposer import NgramProposer
from attnserve.spec_decode.proposer import Proposer
from attnserve.step_types import (
    AsyncStepOutput,
    LaunchedForward,
    StepPlan,
    StepResults,
    TokenBitmask,
)
from attnserve.worker.model_runner import ModelRunner
from attnserve.worker.step_future import DeferredStep, StepFuture
from attnserve.worker.step_sampling import ForwardPass

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        device: torch.device,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = device
        self.distributed_init_method = distributed_init_method
        self.model_runner: ModelRunner | None = None
        self.proposer: Proposer | None = None

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("the worker has no model yet (load_model)")
        return self.model_runner

    def init_device(self) -> None:
        """Join the tensor-parallel group (when there is more than one rank) and seed."""
        world_size = self.config.parallel_config.world_size
        if world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("more than one rank needs a distributed_init_method")
            if self.device.type == "cpu" and self.rank > 0:
                torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
            init_distributed_environment(
                world_size,
                self.rank,
                self.distributed_init_method,
                self.device.index or 0,
                self.device.type,
            )
        torch.manual_seed(self.config.seed)

    def load_model(self) -> KVCacheInfo:
        """Build this rank's model shard and KV cache (the ranks agree on the block count), in
        phases: load, size the activations, allocate the cache, calibrate, warm up, capture;
        answer the KV cache it allocated (the executor's to hand to the engine)."""
        config = self.config
        runner = ModelRunner(config, self.device)
        runner.load_model()
        draft = self._load_proposer()
        if draft is None:
            runner.initialize_kv_cache(runner.profile_activation_memory())
        else:
            self._make_kv_caches_with_draft(runner, draft)
        runner.calibrate_kv_scales()
        if draft is not None:
            draft.calibrate_kv_scales()
        runner.warm_up()
        if draft is not None:  # its catch-up passes compile their kernels now, not in a run
            draft.warm_up()
        # Captured graphs would hold the ranks' collectives; tensor parallelism runs eagerly.
        if not config.enforce_eager and config.parallel_config.world_size == 1:
            runner.capture_graphs()
            if draft is not None:  # its one-token draft steps replay graphs too
                draft.capture_graphs()
        self.model_runner = runner
        windows = tuple(runner.kv_cache_windows)
        return KVCacheInfo(runner.num_blocks, runner.num_swap_blocks, windows)

    def _load_proposer(self) -> ModelRunner | None:
        """The proposer of speculative decoding, if any; where a draft model proposes, its
        runner, loaded, its cache not yet made."""
        config, spec = self.config, self.config.speculative_config
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        if config.draft_model_config is None or spec is None:
            return None
        # one KV-cache group, following the target's group 0 (which keeps every block when
        # the target has global layers)
        cache_config = dataclasses.replace(
            config.cache_config, disable_hybrid_kv_cache_manager=True
        )
        draft_config = dataclasses.replace(  # the draft runs without LoRA adapters
            config,
            model_config=config.draft_model_config,
            cache_config=cache_config,
            lora_config=None,
        )
        draft = ModelRunner(draft_config, self.device)
        try:
            draft.load_model()
        except torch.OutOfMemoryError as error:
            raise ValueError(
                f"speculative_config.model {spec.model!r} does not fit in memory beside the "
                f"target: {error}"
            ) from None
        self.proposer = DraftModelProposer(draft, spec.num_speculative_tokens)
        return draft

    def _make_kv_caches_with_draft(self, runner: ModelRunner, draft: ModelRunner) -> None:
        """The target's KV cache, each block paying for the draft's of the same id too, then
        the draft's. The two run in turn, so the larger of their profile runs' peaks stays free
        (on CUDA without a fixed KV budget, where profile runs run: the draft's also compiles
        now what its catch-up of many sequences takes). A draft that leaves no room for a
        block is refused by name."""
        activations = max(runner.profile_activation_memory(), draft.profile_activation_memory())
        try:
            runner.initialize_kv_cache(activations, draft.bytes_per_block())
        except ValueError as error:
            model = draft.model_config.model
            raise ValueError(
                f"speculative_config.model {model!r}, its KV cache beside the target's: {error}"
            ) from None
        draft.initialize_kv_cache_of(runner.num_blocks, runner.num_swap_blocks)

    def _run(self, plan: StepPlan) -> StepResults:
        """Run one step here; with speculative decoding, the proposals ride on the results."""
        if self.proposer is not None:
            self.proposer.take_in_pending()
        results = self.runner.execute(plan)
        if self.proposer is not None:
            self.proposer.propose_drafts(plan, results, self.runner.input_batch)
        return results

    def execute_model_async(self, plan: StepPlan) -> AsyncStepOutput:
        """Launch one step on a single rank (its draws read back later). With speculative
        decoding a step that drafts runs with its proposals at once; any other is launched as
        usual (a draft model takes it in when it is read back)."""
        if self.proposer is None:
            return self.runner.execute_async(plan)
        if not plan.draft_seq_ids:
            return self.proposer.follow_later(plan, self.runner.execute_async(plan))
        return StepFuture(len(plan.seq_ids), ready=self._run(plan))

    def launch_forward(self, plan: StepPlan) -> LaunchedForward:
        """Launch a step's forward pass on a single rank, its draws once its token bitmask is
        handed over (`sample`). With speculative decoding a step that drafts runs whole then;
        any other is launched now (a draft model takes it in when it is read back)."""
        if self.proposer is None:
            return self.runner.launch_forward(plan)
        if plan.draft_seq_ids:
            return DeferredStep(plan, self.execute_model_async)
        return _FollowedWhenSampled(self.proposer, plan, self.runner.launch_forward(plan))

    def execute_model(self, plan: StepPlan) -> StepResults:
        """On the driver: send the step to the other ranks, then run it here."""
        broadcast_object(plan)
        return self._run(plan)

    def execute_model_loop(self) -> None:
        """On the other ranks: run every step the driver sends, until it sends None."""
        while True:
            plan: StepPlan | None = broadcast_object()
            if plan is None:
                return
            self._run(plan)

    def stop_remote_loops(self) -> None:
        """On the driver: end the other ranks' `execute_model_loop`."""
        broadcast_object(None)

    def shutdown(self) -> None:
        self.model_runner = self.proposer = None
        destroy_distributed_environment()


class _FollowedWhenSampled:
    """A launched forward pass whose draws, once launched, the proposer follows."""

    def __init__(self, proposer: Proposer, plan: StepPlan, forward: ForwardPass) -> None:
        self._proposer = proposer
        self._plan = plan
        self._forward = forward

    def sample(self, token_bitmask: TokenBitmask | None) -> AsyncStepOutput:
        return self._proposer.follow_later(self._plan, self._forward.sample(token_bitmask))
