"""Drives any attention backend through its public API, and a dense fp32 reference to check it.

The harness never looks inside a KV cache: context is written by running the backend itself on
an earlier step, so a backend with any layout can be checked. It builds everything as the model
runner does: an `Attention` layer describes its spec, the backend is bound to it (checked
against that spec), one builder is made per spec, each step's `StepLayout` comes from
`build_step_layout`, and the layer runs under `set_forward_context`.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention import (
    Attention,
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    StepLayout,
    attention_specs,
    bind_attention_backend,
    bind_kv_caches,
    build_metadata,
    build_step_layout,
    metadata_builders,
    set_forward_context,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
# e4m3 keeps 3 mantissa bits: each K/V element is off by up to 2^-4 of itself, and an output
# averaging a few values (a short window) keeps errors of that size
FP8_TOLERANCE = 0.125
# Backends whose kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1), which
# is orders of magnitude slower than native code: the suite gives them shorter sequences.
INTERPRETED_ON_CPU = {"TRITON"}


def runs_interpreted(backend: type[AttentionBackend], device: str) -> bool:
    return (
        device == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and backend.get_name() in INTERPRETED_ON_CPU
    )


@dataclass(frozen=True)
class Case:
    num_kv_heads: int
    group: int  # query heads per KV head
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    alibi: bool = False
    soft_cap: float | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def spec(self, device: str) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            block_size=self.block_size,
            device=device,
            sliding_window=self.sliding_window,
            use_alibi=self.alibi,
            logits_soft_cap=self.soft_cap,
        )

    def alibi_slopes(self) -> torch.Tensor | None:
        if not self.alibi:
            return None
        return torch.tensor(
            [2.0 ** (-8.0 * (h + 1) / self.num_heads) for h in range(self.num_heads)]
        )


@dataclass
class Sequence:
    """One sequence of the test: its full q/k/v, how much is cached, how much is new."""

    q: torch.Tensor  # [L, H, D] fp32
    k: torch.Tensor  # [L, Hkv, D] fp32
    v: torch.Tensor
    context_len: int
    blocks: list[int]

    @property
    def length(self) -> int:
        return int(self.q.shape[0])


def make_sequences(
    case: Case, lengths: list[tuple[int, int]], rng: random.Random
) -> list[Sequence]:
    """Sequences with (context_len, query_len) each, on random shuffled non-contiguous blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    per_seq = [-(-(c + q) // case.block_size) for c, q in lengths]
    pool = list(range(sum(per_seq) * 2 + 1))
    rng.shuffle(pool)
    sequences, used = [], 0
    for (context, query), count in zip(lengths, per_seq, strict=True):
        total = context + query
        q, k, v = (
            torch.randn(total, heads, case.head_size, generator=gen).to(case.dtype).float()
            for heads in (case.num_heads, case.num_kv_heads, case.num_kv_heads)
        )
        sequences.append(Sequence(q, k, v, context, pool[used : used + count]))
        used += 2 * count  # leave holes so tables are not contiguous
    return sequences


def num_cache_blocks(sequences: list[Sequence]) -> int:
    return max(max(s.blocks, default=0) for s in sequences) * 2 + 2


@contextmanager
def _building(dtype: torch.dtype, device: str) -> Iterator[None]:
    """Modules made inside get `dtype` and `device` by default, as the model loader does."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


class Runner:
    """One `Attention` layer bound to a backend, its spec's builder and one KV cache (filled
    with garbage first)."""

    def __init__(
        self, backend: type[AttentionBackend], case: Case, num_blocks: int, device: str
    ) -> None:
        self.backend, self.case, self.device = backend, case, device
        with _building(case.dtype, device):
            self.layer = Attention(
                case.num_heads,
                case.head_size,
                1.0 / math.sqrt(case.head_size),
                case.num_kv_heads,
                alibi_slopes=case.alibi_slopes(),
                sliding_window=case.sliding_window,
                logits_soft_cap=case.soft_cap,
                kv_cache_dtype=case.kv_cache_dtype,
                block_size=case.block_size,
            )
        bind_attention_backend(self.layer, backend)
        self.builders = metadata_builders(backend, attention_specs(self.layer), device)
        self.kv_cache = self.new_cache(num_blocks, device)

    @property
    def spec(self) -> AttentionSpec:
        return self.layer.spec

    @property
    def builder(self) -> AttentionMetadataBuilder[Any]:
        return self.builders[self.spec]

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.layer.kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor) -> None:
        bind_kv_caches(self.layer, [cache])

    def calibrate(self, seqs: list[Sequence]) -> None:
        """An fp8 cache's scales from every K/V of `seqs`, as the model runner calibrates them
        on a prefill; other caches have none."""
        scales = self.layer.kv_scales
        if scales is not None:
            keys, values = (torch.cat([getattr(s, name) for s in seqs]) for name in "kv")
            scales.observe(keys.to(self.device), values.to(self.device))

    def new_cache(self, num_blocks: int, device: str) -> torch.Tensor:
        c = self.case
        shape = self.backend.get_kv_cache_shape(
            num_blocks, c.block_size, c.num_kv_heads, c.head_size
        )
        dtype = self.backend.get_kv_cache_torch_dtype(c.kv_cache_dtype, c.dtype)
        return (torch.randn(shape) * 100).to(dtype=dtype, device=device)

    def layout(self, seqs: list[Sequence], spans: list[tuple[int, int]]) -> StepLayout:
        """The step over token spans [start, end) of each sequence."""
        return build_step_layout(
            [s.blocks for s in seqs],
            [a for a, _ in spans],
            [b - a for a, b in spans],
            self.case.block_size,
        )

    def step(self, seqs: list[Sequence], spans: list[tuple[int, int]]) -> torch.Tensor:
        """Run one step over token spans [start, end) of each sequence; return [T, H, D]."""
        metadata = build_metadata(self.builders, self.layout(seqs, spans))
        return self.forward(seqs, spans, metadata[self.spec])

    def forward(
        self, seqs: list[Sequence], spans: list[tuple[int, int]], meta: AttentionMetadata
    ) -> torch.Tensor:
        def flat(name: str) -> torch.Tensor:
            parts = [getattr(s, name)[a:b] for s, (a, b) in zip(seqs, spans, strict=True)]
            return torch.cat(parts).flatten(1).to(self.case.dtype).to(self.device)

        with set_forward_context({self.spec: meta}):
            out = self.layer(flat("q"), flat("k"), flat("v"))
        return out.float().cpu().view(-1, self.case.num_heads, self.case.head_size)


def reference(case: Case, seq: Sequence, start: int, end: int) -> torch.Tensor:
    """Dense fp32 causal attention of rows start..end-1 over keys 0..row."""
    q = seq.q[start:end].transpose(0, 1)  # [H, Q, D]
    k = seq.k.repeat_interleave(case.group, dim=1).transpose(0, 1)  # [H, L, D]
    v = seq.v.repeat_interleave(case.group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) / math.sqrt(case.head_size)
    if case.soft_cap is not None:
        scores = case.soft_cap * torch.tanh(scores / case.soft_cap)
    rows = torch.arange(start, end)[:, None]
    cols = torch.arange(seq.length)[None, :]
    slopes = case.alibi_slopes()
    if slopes is not None:
        scores = scores + slopes[:, None, None] * (cols - rows).float()
    allowed = cols <= rows
    if case.sliding_window is not None:
        allowed &= rows - cols < case.sliding_window
    probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return (probs @ v).transpose(0, 1)


def check_close(case: Case, got: torch.Tensor, want: torch.Tensor) -> None:
    tol = FP8_TOLERANCE if case.kv_cache_dtype == "fp8" else TOLERANCE[case.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
