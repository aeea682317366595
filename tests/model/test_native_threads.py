"""The native kernels on the shared thread pool (`native/native_pool.c`): on 2 and 3 threads every
kernel gives bit for bit what it gives on one (each output is computed whole by one thread),
including shapes of many chunks and a ragged last one; calls from several Python threads at once
(one runs on the pool, the others on their own thread) stay correct; and the packed layers'
BLAS path, chunk by chunk into column slices, equals the dequantized product."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from attnserve.attention.ops.cpu_attention import cpu_attention_library, cpu_paged_attention
from attnserve.model.layers import cpu_ops
from attnserve.model.quantization import gguf as gguf_method
from attnserve.model.quantization.gguf import PackedSegment
from attnserve.model.quantization.gguf_blocks import from_blocks
from attnserve.model.quantization.gguf_cpu import NativeWeight, native_library

pytestmark = pytest.mark.skipif(
    native_library() is None
    or cpu_attention_library() is None
    or cpu_ops.cpu_ops_library() is None,
    reason="no AVX2 CPU or C compiler here",
)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on_threads(run: Callable[[], object]) -> list[object]:
    """`run()` on 1, 2 and 3 threads."""
    results = []
    for count in (1, 2, 3):
        with torch_threads(count):
            results.append(run())
    return results


def _all_equal(results: list[object]) -> bool:
    flat = [r if isinstance(r, tuple) else (r,) for r in results]
    return all(torch.equal(a, b) for other in flat[1:] for a, b in zip(flat[0], other, strict=True))


def _weight(qtype: str, n: int, k: int, seed: int) -> tuple[NativeWeight, torch.Tensor, object]:
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
    weight = from_blocks(qtype, raw, (n, k))
    return NativeWeight(weight), dense, weight


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k", "m"), [(1001, 576, 1), (333, 1536, 5), (7, 96, 12)])
def test_packed_kernels_equal_on_any_thread_count(qtype: str, n: int, k: int, m: int) -> None:
    native, dense, _ = _weight(qtype, n, k, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    assert _all_equal(_on_threads(lambda: native.mm(x)))
    rows = torch.tensor([n - 1, 0, n // 2, 3 % n])
    dequantized = _on_threads(native.dequantize)
    assert _all_equal(dequantized) and torch.equal(dequantized[0], dense)
    looked_up = _on_threads(lambda: native.dequantize_rows(rows))
    assert _all_equal(looked_up) and torch.equal(looked_up[0], dense[rows])


def test_blas_path_in_chunks_equals_the_dequantized_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Weight rows in chunks of 7 (a ragged last one), each chunk's product written into its
    column slice of the output (20 activation rows: past the native limit, lowered to 12)."""
    monkeypatch.setattr(gguf_method, "CHUNK_FLOATS", 7 * 64)
    monkeypatch.setattr(gguf_method, "NATIVE_MAX_ROWS", {"avx2": 12, "avx512": 12})
    _, dense, weight = _weight("Q4_1", 50, 64, seed=3)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(4))
    got = _on_threads(lambda: PackedSegment(weight).mm(x))
    assert _all_equal(got) and got[0].is_contiguous()
    exact = x.double() @ dense.double().t()
    assert (got[0].double() - exact).abs().max() < 1e-5 * exact.abs().max()


def test_concurrent_callers_get_their_own_results() -> None:
    native, _, _ = _weight("Q4_1", 640, 256, seed=5)
    inputs = [torch.randn(2, 256, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    with torch_threads(1):
        expected = [native.mm(x) for x in inputs]
    failures: list[int] = []

    def call(index: int) -> None:
        for _ in range(30):
            if not torch.equal(native.mm(inputs[index]), expected[index]):
                failures.append(index)

    with torch_threads(2):
        callers = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    assert failures == []


def test_attention_equal_on_any_thread_count() -> None:
    """A prefill of 37 tokens and a decode token of another sequence, GQA 3:1."""
    heads, kv_heads, size, block = 6, 2, 24, 4
    g = torch.Generator().manual_seed(6)
    kv_cache = torch.randn(2, 32, block, kv_heads, size, generator=g)
    block_table = torch.arange(32).view(2, 16).contiguous()
    token_seq = torch.tensor([0] * 37 + [1])
    token_pos = torch.cat([torch.arange(37), torch.tensor([50])])
    slots = block_table[token_seq, token_pos // block] * block + token_pos % block
    tables = (slots, token_seq, token_pos, block_table)
    q = torch.randn(38, heads * size, generator=g)
    k, v = torch.randn(2, 38, kv_heads * size, generator=g)

    def attend() -> torch.Tensor:
        cache = kv_cache.clone()
        return cpu_paged_attention(
            q, k, v, cache, tables, (heads, kv_heads, size), 0.2, None, None, None
        )

    assert _all_equal(_on_threads(attend))


def test_small_ops_equal_on_any_thread_count() -> None:
    g = torch.Generator().manual_seed(7)
    x, residual, weight = (
        torch.randn(300, 96, generator=g),
        torch.randn(300, 96, generator=g),
        torch.randn(96, generator=g),
    )
    gate_up = torch.randn(300, 2 * 43, generator=g)
    cos_sin = torch.randn(400, 16, generator=g)
    positions = torch.randint(0, 400, (300,), generator=g)
    assert _all_equal(_on_threads(lambda: cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)))
    assert _all_equal(_on_threads(lambda: cpu_ops.silu_and_mul(gate_up)))
    assert _all_equal(
        _on_threads(lambda: cpu_ops.rotary_embedding(positions, x[:, :64], x[:, 64:], cos_sin, 16))
    )
