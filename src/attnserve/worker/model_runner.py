"""`ModelRunner`: turns a scheduled batch into tensors, runs the model, samples.

It selects the attention backend once, loads the model with it, sizes and binds the KV cache,
and each step asks that backend's metadata builder for the attention metadata. It never looks at
the metadata or the cache layout itself.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from attnserve.attention import bind_kv_caches, get_attn_backend, set_forward_context
from attnserve.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from attnserve.distributed import get_tensor_model_parallel_world_size
from attnserve.distributed.communication import tensor_model_parallel_all_reduce_min
from attnserve.model.config import ModelConfig
from attnserve.model.loader import load_model
from attnserve.model.sampler import Sampler, top_logprobs
from attnserve.worker.batch import SampleOutput, ScheduledBatch
from attnserve.worker.cache_engine import (
    CacheEngine,
    gpu_kv_cache_budget,
    num_blocks_for_budget,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        attention_backend: str | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        tp_size = get_tensor_model_parallel_world_size()  # this rank's share of the heads
        self.num_heads = model_config.get_num_attention_heads(tp_size)
        self.num_kv_heads = model_config.get_num_kv_heads(tp_size)
        self.backend = get_attn_backend(
            model_config.head_size,
            model_config.dtype,
            kv_cache_dtype=cache_config.kv_cache_dtype,
            block_size=cache_config.block_size,
            device=device,
            sliding_window=model_config.sliding_window,
            attention_backend=attention_backend,
        )
        self.model = load_model(model_config, self.backend, device, cache_config.kv_cache_dtype)
        self.cache_engine = self._allocate_kv_cache()
        bind_kv_caches(self.model, self.cache_engine.kv_caches)
        self.builder = self.backend.get_builder_cls()(
            cache_config.block_size,
            device,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=model_config.head_size,
        )
        self.sampler = Sampler()

    @property
    def num_blocks(self) -> int:
        return self.cache_engine.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.cache_engine.num_swap_blocks

    def _allocate_kv_cache(self) -> CacheEngine:
        mc, cc = self.model_config, self.cache_config
        per_block = CacheEngine.bytes_per_block(
            self.backend,
            mc.num_layers,
            self.num_kv_heads,
            mc.head_size,
            cc.block_size,
            mc.dtype,
            cc.kv_cache_dtype,
        )
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = gpu_kv_cache_budget(cc.gpu_memory_utilization, self.device)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        # every rank must hold the same blocks: the smallest count any rank can afford
        num_blocks = tensor_model_parallel_all_reduce_min(num_blocks_for_budget(budget, per_block))
        num_swap_blocks = cc.swap_space_bytes // per_block
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, backend %s), up to %d tokens",
            num_blocks,
            cc.block_size,
            num_blocks * per_block / 2**30,
            self.backend.get_name(),
            num_blocks * cc.block_size,
        )
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

    def _prepare_inputs(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat token ids and positions of the step's new tokens (built on the host, one copy)."""
        query_lens = torch.tensor([len(s.token_ids) for s in batch.seqs])
        context_lens = torch.tensor([s.context_len for s in batch.seqs])
        starts = torch.cumsum(query_lens, 0) - query_lens
        owner = torch.repeat_interleave(torch.arange(len(batch.seqs)), query_lens)
        positions = torch.arange(int(query_lens.sum())) - starts[owner] + context_lens[owner]
        token_ids = torch.tensor([t for s in batch.seqs for t in s.token_ids], dtype=torch.int64)
        return token_ids.to(self.device), positions.to(self.device)

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        """Swaps and copy-on-write copies, before the forward pass that may reuse the blocks."""
        for pairs, move in (
            (batch.blocks_to_swap_out, self.cache_engine.swap_out),
            (batch.blocks_to_swap_in, self.cache_engine.swap_in),
            (batch.blocks_to_copy, self.cache_engine.copy),
        ):
            if pairs:
                move(torch.tensor(pairs, dtype=torch.int64))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SampleOutput | None]:
        """Run one step; return each sequence's draws (None where nothing is drawn)."""
        self._move_blocks(batch)
        token_ids, positions = self._prepare_inputs(batch)
        metadata = self.builder.build(
            [s.block_table for s in batch.seqs],
            [s.context_len for s in batch.seqs],
            [len(s.token_ids) for s in batch.seqs],
        )
        with set_forward_context(metadata):
            hidden = self.model(token_ids, positions)
        starts = torch.cumsum(torch.tensor([len(s.token_ids) for s in batch.seqs]), 0).tolist()
        starts = [0, *starts]
        results: list[SampleOutput | None] = [None] * len(batch.seqs)
        rows = [i for i, s in enumerate(batch.seqs) if s.sampling is not None]
        if rows:
            last = torch.tensor([starts[i + 1] - 1 for i in rows], device=self.device)
            logits = self.model.compute_logits(hidden[last])
            drawn = self.sampler(logits, [batch.seqs[i] for i in rows])
            for row, result in zip(rows, drawn, strict=True):
                results[row] = result
        self._add_prompt_logprobs(batch, hidden, starts, results)
        return results

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
            chosen = torch.tensor(targets, device=self.device)
            entries = top_logprobs(logprobs, chosen, [seq.num_prompt_logprobs] * len(targets))
            previous = results[i] or SampleOutput([])
            results[i] = dataclasses.replace(previous, prompt_logprobs=entries)
