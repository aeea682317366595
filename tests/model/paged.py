"""Drives a model through the paged KV cache the way the model runner does: one flat prefill
step for all prompts, then one-token decode steps, each under set_forward_context."""

from __future__ import annotations

import torch

from attnserve.attention import (
    AttentionBackend,
    bind_kv_caches,
    get_attn_backend,
    set_forward_context,
)
from attnserve.model.config import ModelConfig
from attnserve.model.models.llama import LlamaForCausalLM
from attnserve.worker.cache_engine import CacheEngine

BLOCK_SIZE = 4


def reference_backend(config: ModelConfig, device: str = "cpu") -> type[AttentionBackend]:
    return get_attn_backend(
        config.head_size,
        config.dtype,
        device=device,
        sliding_window=config.sliding_window,
        attention_backend="TORCH_SDPA",
    )


class PagedRunner:
    """Sequences live on interleaved (non-contiguous) blocks of one CacheEngine."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        max_len: int,
        seqs: int,
        device: str = "cpu",
    ) -> None:
        backend = model.model.layers[0].self_attn.attn.backend
        blocks_per_seq = -(-max_len // BLOCK_SIZE)
        self.cache = CacheEngine(
            backend,
            config.num_layers,
            config.num_kv_heads,
            config.head_size,
            BLOCK_SIZE,
            blocks_per_seq * seqs + 1,
            config.dtype,
            device,
        )
        bind_kv_caches(model, self.cache.kv_caches)
        self.model = model
        self.device = device
        self.builder = backend.get_builder_cls()(BLOCK_SIZE, device)
        self.tables = [[1 + s + j * seqs for j in range(blocks_per_seq)] for s in range(seqs)]
        self.lens = [0] * seqs

    @torch.no_grad()
    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed each sequence its new tokens; return each one's logits [len(new), vocab]."""
        query_lens = [len(t) for t in new_tokens]
        metadata = self.builder.build(self.tables, self.lens, query_lens)
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.device)
        positions = torch.cat(
            [torch.arange(c, c + q) for c, q in zip(self.lens, query_lens, strict=True)]
        )
        with set_forward_context(metadata):
            hidden = self.model(ids, positions.to(self.device))
        self.lens = [c + q for c, q in zip(self.lens, query_lens, strict=True)]
        return list(self.model.compute_logits(hidden).split(query_lens))

    def run(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
        """Prefill `prompts` in one step, then decode `continuations` token by token; return
        each sequence's logits at every position."""
        outputs = [[chunk] for chunk in self.step(prompts)]
        for position in range(len(continuations[0])):
            for out, chunk in zip(
                outputs, self.step([[c[position]] for c in continuations]), strict=True
            ):
                out.append(chunk)
        return [torch.cat(chunks) for chunks in outputs]
