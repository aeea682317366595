"""TRITON kernels beyond the shared suite: split-KV decode, the fp8 cache, head sizes 96/256.

Runs on CUDA when present, else through the Triton interpreter on the CPU (conftest switches it
on). References are dense fp32 attention over a gathered copy of the paged cache.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnserve.attention import KVCacheScales, get_backend_cls
from tests.attention.harness import TOLERANCE, Case, Sequence, reference
from tests.attention.test_conformance import _setup

BACKEND = get_backend_cls("TRITON")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if BACKEND.unavailable_reason() or DEVICE not in BACKEND.capabilities.devices:
    pytest.skip("TRITON does not run here", allow_module_level=True)

from attnserve.attention.ops.triton_cache import reshape_and_cache  # noqa: E402
from attnserve.attention.ops.triton_common import (  # noqa: E402
    AttentionParams,
    KernelConfig,
    fp8_mode,
)
from attnserve.attention.ops.triton_decode import paged_decode  # noqa: E402


def _paged_cache(
    seq_lens: list[int], kv_heads: int, head_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache, a shuffled block table for `seq_lens`, and the dense K/V [B, 2, Hkv, L, D]
    (zero past each sequence's end)."""
    per_seq = -(-max(seq_lens) // block_size)
    gen = torch.Generator().manual_seed(1)
    num_blocks = len(seq_lens) * per_seq + 3
    cache = torch.randn(num_blocks, 2, kv_heads, block_size, head_size, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * per_seq]
    table = order.view(len(seq_lens), per_seq)
    dense = cache[table].permute(0, 2, 3, 1, 4, 5).flatten(3, 4)
    return cache, table.to(torch.int32), dense


def _decode_reference(
    q: torch.Tensor, dense: torch.Tensor, seq_lens: list[int], window: int | None
) -> torch.Tensor:
    group = q.shape[1] // dense.shape[2]
    outs = []
    for i, length in enumerate(seq_lens):
        lo = 0 if window is None else max(0, length - window)
        k = dense[i, 0, :, lo:length].repeat_interleave(group, 0)  # [H, L, D]
        v = dense[i, 1, :, lo:length].repeat_interleave(group, 0)
        probs = torch.softmax((k @ q[i, :, :, None])[..., 0] / math.sqrt(q.shape[-1]), -1)
        outs.append((probs[:, None, :] @ v)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, None), (4, 50)])
def test_split_kv_decode_matches_reference(num_splits: int, window: int | None) -> None:
    seq_lens, kv_heads, group, head_size, block_size = [1, 37, 300, 129], 2, 3, 64, 16
    cache, table, dense = _paged_cache(seq_lens, kv_heads, head_size, block_size)
    q = torch.randn(len(seq_lens), kv_heads * group, head_size)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_decode(
        q.to(DEVICE),
        cache.to(DEVICE),
        table.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        out,
        AttentionParams(scale=1 / math.sqrt(head_size), sliding_window=window),
        num_splits,
    )
    want = _decode_reference(q, dense, seq_lens, window)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)


# the decode tiles `default_decode_config` picks on CUDA (keys, warps, stages): fp8's, bf16's
FP8_DECODE_TILES = [KernelConfig(16, n, w, s) for n, w, s in ((64, 2, 5), (32, 2, 5), (64, 4, 3))]


@pytest.mark.parametrize("tile", FP8_DECODE_TILES, ids=str)
@pytest.mark.parametrize(("head_size", "num_splits"), [(128, 1), (80, 3)])
def test_fp8_cache_decode_tiles_match_reference(
    tile: KernelConfig, head_size: int, num_splits: int
) -> None:
    seq_lens, kv_heads, group, block_size = [5, 130, 300, 64], 2, 4, 16
    cache, table, _ = _paged_cache(seq_lens, kv_heads, head_size, block_size)
    cache = cache.to(torch.float8_e4m3fn)
    dense = cache.float()[table.long()].permute(0, 2, 3, 1, 4, 5).flatten(3, 4)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q = torch.randn(len(seq_lens), kv_heads * group, head_size)
    out = torch.full_like(q, float("nan"), dtype=dtype, device=DEVICE)
    paged_decode(
        q.to(DEVICE, dtype),
        cache.to(DEVICE),
        table.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        out,
        AttentionParams(scale=1 / math.sqrt(head_size)),
        num_splits,
        tile,
    )
    want = _decode_reference(q.to(dtype).float(), dense, seq_lens, None)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)


def test_fp8_mode_takes_the_pair_conversion_only_for_half_precision_queries_on_cuda() -> None:
    bf16_cache = torch.zeros(1, 2, 1, 16, 8, dtype=torch.bfloat16, device=DEVICE)
    fp8_cache = bf16_cache.to(torch.float8_e4m3fn)
    query = torch.zeros(1, 2, 8, dtype=torch.bfloat16, device=DEVICE)
    assert fp8_mode(bf16_cache, query) == 0
    assert fp8_mode(fp8_cache, query.float()) == 1  # fp32 dots convert with Triton's casts
    if DEVICE == "cpu":
        assert fp8_mode(fp8_cache, query) == 1  # the interpreter has no inline assembly
    elif torch.cuda.get_device_capability() >= (8, 9):
        assert fp8_mode(fp8_cache, query) == 2


def test_fp8_cache_write_scales_each_head_saturates_and_skips_padding() -> None:
    kv_heads, head_size, block_size = 2, 64, 16
    cache = torch.zeros(4, 2, kv_heads, block_size, head_size, dtype=torch.float8_e4m3fn)
    cache = cache.to(DEVICE)
    key = torch.randn(3, kv_heads, head_size) * 100
    key[0, 0, 0] = 5000.0  # beyond e4m3's range once scaled: saturates at 448
    value = torch.randn(3, kv_heads, head_size)
    slots = torch.tensor([5, -1, 3 * block_size + 7])
    scales = torch.tensor([[2.0, 4.0], [0.5, 0.25]], device=DEVICE)  # [K/V, head]
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), cache, slots.to(DEVICE), scales)
    got = cache.cpu().float()
    head_scales = scales.cpu()[:, None, :, None]  # [K/V, token, head, dim]
    want_k = (key / head_scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    want_v = (value / head_scales[1]).to(torch.float8_e4m3fn).float()
    for token, slot in ((0, 5), (2, 3 * block_size + 7)):
        block, offset = divmod(slot, block_size)
        assert torch.equal(got[block, 0, :, offset], want_k[token])
        assert torch.equal(got[block, 1, :, offset], want_v[token])
    assert got[0, 0, 0, 5, 0] == 448.0
    written = {(0, 5), (3, 7)}
    untouched = [(b, o) for b in range(4) for o in range(block_size) if (b, o) not in written]
    assert all(not got[b, :, :, o].any() for b, o in untouched)


def test_cache_write_into_a_token_major_cache_through_its_transposed_view() -> None:
    kv_heads, head_size, block_size = 2, 32, 4
    cache = torch.zeros(3, 2, block_size, kv_heads, head_size, device=DEVICE)  # FlashAttention's
    key, value = torch.randn(3, kv_heads, head_size), torch.randn(3, kv_heads, head_size)
    slots = torch.tensor([6, -1, 1])
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), cache.transpose(2, 3), slots.to(DEVICE))
    got = cache.cpu()
    assert torch.equal(got[1, 0, 2], key[0]) and torch.equal(got[1, 1, 2], value[0])
    assert torch.equal(got[0, 0, 1], key[2]) and torch.equal(got[0, 1, 1], value[2])
    got[1, :, 2] = 0
    got[0, :, 1] = 0
    assert not got.any()  # padding (slot -1) wrote nothing


@pytest.mark.parametrize(
    "case",
    [
        Case(num_kv_heads=2, group=2, head_size=96, block_size=16, dtype=torch.bfloat16,
             kv_cache_dtype="fp8", seed=3),
        Case(num_kv_heads=1, group=4, head_size=256, block_size=256, dtype=torch.float16,
             sliding_window=7, seed=4),
        Case(num_kv_heads=2, group=1, head_size=128, block_size=64, dtype=torch.float16,
             kv_cache_dtype="fp8", alibi=True, soft_cap=10.0, seed=5),
        Case(num_kv_heads=2, group=4, head_size=128, block_size=16, dtype=torch.float32,
             kv_cache_dtype="fp8", seed=6),
    ],
    ids=str,
)  # fmt: skip
def test_backend_cases_beyond_the_shared_grid(case: Case) -> None:
    """Two steps (context prefill, then mixed) against the dense reference. An fp8 cache is
    checked at the compute dtype's tolerance against K/V stored as the kernels store them:
    divided by the layer's calibrated per-head scales, rounded to e4m3 the way torch does, times
    the scales; a prefill of plain attention reads its own new K/V from the step, unrounded."""
    runner, seqs = _setup(BACKEND, case, DEVICE)
    scales = runner.layer.kv_scales
    assert scales is None or not torch.all(scales.scales == 1.0)
    tol = TOLERANCE[case.dtype]
    cached = [i for i, s in enumerate(seqs) if s.context_len > 0]
    steps = [
        (cached, lambda s: (0, s.context_len)),
        (range(len(seqs)), lambda s: (s.context_len, s.length)),
    ]
    for members, span in steps:
        spans = [span(seqs[i]) for i in members]
        got = runner.step([seqs[i] for i in members], spans)
        want = torch.cat(
            [
                reference(case, _as_stored(seqs[i], case, scales, *ab), *ab)
                for i, ab in zip(members, spans, strict=True)
            ]
        )
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _as_stored(
    seq: Sequence, case: Case, scales: KVCacheScales | None, start: int, end: int
) -> Sequence:
    """`seq` as a step over tokens [start, end) sees it through an fp8 cache: every key and
    value rounded, but a prefill's own (from `start` on) where the kernel reads them from the
    step (plain attention, a power-of-two head size)."""
    if scales is None:
        return seq
    plain = case.sliding_window is None and not case.alibi and case.soft_cap is None
    prefill = end - start > 1 or start == 0
    fresh_from = start if prefill and plain and case.head_size & (case.head_size - 1) == 0 else end

    def stored(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        per_head = scale.cpu()[None, :, None]
        rounded = (x / per_head).to(torch.float8_e4m3fn).float() * per_head
        return torch.cat([rounded[:fresh_from], x[fresh_from:]])

    return dataclasses.replace(
        seq, k=stored(seq.k, scales.k_scale), v=stored(seq.v, scales.v_scale)
    )
