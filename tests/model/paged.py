"""Drives a model through the paged KV cache the way the model runner does: one flat prefill
step for all prompts, then one-token decode steps, each step's metadata built from its layout by
one builder per spec and set with set_forward_context."""

from __future__ import annotations

import torch

from attnserve.attention import (
    attention_specs,
    bind_attention_backend,
    bind_kv_caches,
    build_metadata,
    build_step_layout,
    get_model_attn_backend,
    metadata_builders,
    set_forward_context,
)
from attnserve.model.config import ModelConfig
from attnserve.model.loader import load_model
from attnserve.model.models.llama import LlamaForCausalLM
from attnserve.worker.cache_engine import CacheEngine

BLOCK_SIZE = 4


def load_reference_model(config: ModelConfig) -> LlamaForCausalLM:
    """The model on the CPU, with TORCH_SDPA bound as the model runner binds a backend."""
    model = load_model(config, torch.device("cpu"), block_size=BLOCK_SIZE)
    bind_attention_backend(model, get_model_attn_backend(attention_specs(model), "TORCH_SDPA"))
    return model


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
        if backend is None:
            raise ValueError("bind an attention backend to the model first")
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
        self.builders = metadata_builders(backend, attention_specs(model), device)
        self.tables = [[1 + s + j * seqs for j in range(blocks_per_seq)] for s in range(seqs)]
        self.lens = [0] * seqs

    @torch.no_grad()
    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Feed each sequence its new tokens; return each one's logits [len(new), vocab]."""
        query_lens = [len(t) for t in new_tokens]
        layout = build_step_layout(self.tables, self.lens, query_lens, BLOCK_SIZE)
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.device)
        with set_forward_context(build_metadata(self.builders, layout)):
            hidden = self.model(ids, layout.token_pos.to(self.device))
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
