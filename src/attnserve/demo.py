"""The quick-start demo: one paged step through the selected attention backend."""

from __future__ import annotations

import math

import torch

from attnserve.attention import Attention, get_attn_backend, set_forward_context
from attnserve.engine.block_allocator import BlockAllocator
from attnserve.engine.block_table import BlockTable
from attnserve.worker.cache_engine import CacheEngine


def run_attention_demo() -> int:
    """Prefill three prompts into a paged cache, then decode one token each, and report."""
    heads, kv_heads, head_size, block_size = 8, 2, 64, 16
    backend = get_attn_backend(head_size, torch.float32, block_size=block_size, device="cpu")
    layer = Attention(heads, head_size, 1 / math.sqrt(head_size), kv_heads, backend=backend)
    cache = CacheEngine(backend, 1, kv_heads, head_size, block_size, 32, torch.float32, "cpu")
    layer.kv_cache = cache.kv_caches[0]
    pool = BlockAllocator(cache.num_blocks)
    tables = [BlockTable(pool, block_size) for _ in range(3)]
    builder = backend.get_builder_cls()(block_size, "cpu")
    prompt_lens = [37, 5, 100]
    print(f"backend {backend.get_name()}: {len(tables)} sequences, block size {block_size}")
    for step, (contexts, queries) in enumerate(
        [([0, 0, 0], prompt_lens), (prompt_lens, [1, 1, 1])]
    ):
        for table, ctx, q in zip(tables, contexts, queries, strict=True):
            table.ensure_capacity(ctx + q)
        meta = builder.build([t.blocks for t in tables], contexts, queries)
        tokens = sum(queries)
        q_in = torch.randn(tokens, heads * head_size)
        kv_in = torch.randn(2, tokens, kv_heads * head_size)
        with set_forward_context(meta):
            out = layer(q_in, kv_in[0], kv_in[1])
        kind = "prefill" if step == 0 else "decode"
        print(
            f"  {kind}: {tokens} tokens -> output {tuple(out.shape)}, "
            f"{pool.num_blocks - pool.num_free_blocks} of {pool.num_blocks} blocks in use"
        )
    for table in tables:
        table.free()
    print(f"  freed: {pool.num_free_blocks} of {pool.num_blocks} blocks free")
    return 0
