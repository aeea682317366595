"""GGUF tensors kept packed: the blocks and the matmuls of every packed type against references
computed here from `gguf.quants` (quantize, dequantize) and float64 products, odd shapes included.

Two references: the product with the dequantized weight (the exact paths: large batches through
the BLAS, torch's int4 kernel) and, for the native small-batch kernel, the same product with the
activations rounded the way that kernel documents (per 32-block int16 codes, scale max|x|/32767;
Q4_1's m times the exact block sums of x), which it must meet to float32 accuracy, plus the
bound that rounding puts on its distance from the exact product.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from attnserve.model.quantization.gguf import NATIVE_MAX_ROWS, PackedSegment
from attnserve.model.quantization.gguf_blocks import GGUFWeight, from_blocks
from attnserve.model.quantization.gguf_cpu import (
    KERNELS_ENV,
    NativeWeight,
    kernels,
    native_library,
)
from attnserve.model.quantization.gguf_torch import TorchPackedWeight

TYPES = ("Q4_0", "Q4_1", "Q8_0")
SHAPES = [(16, 32), (7, 96), (33, 160), (100, 64), (1, 32)]  # (N, K): N is not a multiple of 16
# a tile of 4 and a remainder; past every native limit
ROWS = (1, 3, 5, max(NATIVE_MAX_ROWS.values()) + 9)
native = pytest.mark.skipif(native_library() is None, reason="no AVX2 CPU or C compiler here")
avx512 = pytest.mark.skipif(kernels("avx512") is None, reason="no AVX-512 VNNI CPU here")
# both kernel sets where each runs: AVX2's are forced by name on an AVX-512 CPU
ISAS = [
    pytest.param("avx2", marks=native),
    pytest.param("avx512", marks=avx512),
]


def _raw(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    weight = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw: np.ndarray = quantize(weight, GGMLQuantizationType[qtype])
    return raw


def _dequantized(qtype: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float64))


def _sum_factors(qtype: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """Each block's c, the factor of sum(x_g) in the kernel's x . w (gguf_cpu.c): Q4_1's m,
    read from the raw bytes; 0 for the others (their codes carry the whole weight)."""
    blocks = raw.reshape(n, k // 32, -1)
    if qtype == "Q4_1":
        return blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return np.zeros((n, k // 32))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_blocks_dequantize_like_gguf(qtype: str, n: int, k: int) -> None:
    raw = _raw(qtype, n, k, seed=n + k)
    weight = from_blocks(qtype, raw, (n, k))
    expected = _dequantized(qtype, raw).float()
    assert torch.equal(weight.dequantize(), expected)
    assert torch.equal(weight[1:, 32:].dequantize(), expected[1:, 32:])
    for isa in ("avx2", "avx512"):
        if kernels(isa) is not None:
            assert torch.equal(NativeWeight(weight, isa).dequantize(), expected)


def test_columns_split_only_on_blocks() -> None:
    weight = from_blocks("Q4_1", _raw("Q4_1", 4, 64, seed=0), (4, 64))
    assert weight[:, 32:64].shape == (4, 32)
    with pytest.raises(ValueError, match="32-column blocks"):
        _ = weight[:, 16:48]


def _rounded_reference(
    x: torch.Tensor, qtype: str, raw: np.ndarray, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product with x rounded as the native kernel documents, the bound of its distance
    from the exact product)."""
    m = x.shape[0]
    blocks = x.double().view(m, k // 32, 32)
    # the kernel's float32 rounding (gguf_rows.h): codes round(x * (1 / s)), half to even
    scale32 = x.float().view(m, k // 32, 32).abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(scale32 > 0, 1 / scale32, 0)
    scale = scale32.double()
    rounded = torch.round(blocks.float() * inverse).double() * scale
    c = torch.from_numpy(_sum_factors(qtype, raw, n, k))
    weight = _dequantized(qtype, raw)
    sums_gap = blocks.sum(-1) - rounded.sum(-1)  # exact sums in the kernel, rounded ones here
    reference = rounded.view(m, k) @ weight.t() + sums_gap @ c.t()
    # |x - rounded| <= scale / 2 per element, times |w - c| summed over the block
    codes_part = (weight - c.repeat_interleave(32, dim=1)).abs().view(n, k // 32, 32).sum(-1)
    bound = (scale.squeeze(-1) / 2) @ codes_part.t()
    return reference, bound


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
# rows 1..9 (AVX2 tiles of 4 and remainders), one AVX-512 group of 16, groups and a remainder
@pytest.mark.parametrize("m", (*range(1, 10), 16, 37, 64))
def test_native_kernel_against_rounded_reference(
    isa: str, qtype: str, n: int, k: int, m: int
) -> None:
    raw = _raw(qtype, n, k, seed=7 * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = NativeWeight(from_blocks(qtype, raw, (n, k)), isa).mm(x).double()
    reference, bound = _rounded_reference(x, qtype, raw, n, k)
    torch.testing.assert_close(got, reference, atol=1e-5 * reference.abs().max().item(), rtol=0)
    exact = x.double() @ _dequantized(qtype, raw).t()
    assert ((got - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_exact_paths_against_dequantized_product(qtype: str, n: int, k: int, m: int) -> None:
    raw = _raw(qtype, n, k, seed=3 * n + k)
    weight = from_blocks(qtype, raw, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    exact = x.double() @ _dequantized(qtype, raw).t()
    tolerance = {"atol": 2e-5 * exact.abs().max().item(), "rtol": 0}
    torch.testing.assert_close(
        TorchPackedWeight.from_gguf(weight).mm(x).double(), exact, **tolerance
    )
    library = native_library()
    if library is not None and m > NATIVE_MAX_ROWS[library.isa]:
        torch.testing.assert_close(PackedSegment(weight).mm(x).double(), exact, **tolerance)


@native
def test_segment_picks_the_blas_path_past_the_native_limit() -> None:
    raw = _raw("Q8_0", 40, 64, seed=1)
    segment = PackedSegment(from_blocks("Q8_0", raw, (40, 64)))
    x = torch.randn(NATIVE_MAX_ROWS[segment.kernel.isa] + 1, 64)
    exact = x.double() @ _dequantized("Q8_0", raw).t()
    # the dequantized weight through the BLAS: float32 rounding only, far below the int16 bound
    assert (segment.mm(x).double() - exact).abs().max() < 1e-5 * exact.abs().max()


def test_gguf_weight_rows_and_shape() -> None:
    weight = GGUFWeight("Q8_0", torch.zeros(6, 2, 34, dtype=torch.uint8))
    assert weight.shape == (6, 64) and weight.get_shape() == [6, 64]
    assert weight.rows(lambda t: t[:3]).shape == (3, 64)
    with pytest.raises(ValueError, match="not kept quantized"):
        from_blocks("Q6_K", np.zeros(10, dtype=np.uint8), (1, 256))


def _pair(qtype: str, n: int, k: int) -> tuple[NativeWeight, NativeWeight]:
    weight = from_blocks(qtype, _raw(qtype, n, k, seed=5 * n + k), (n, k))
    return NativeWeight(weight, "avx2"), NativeWeight(weight, "avx512")


@avx512
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), [*SHAPES, (48, 576), (40, 1536)])
def test_avx512_kernels_equal_the_avx2_ones_bit_for_bit(qtype: str, n: int, k: int) -> None:
    """The same integer sums and float sums in the same order (gguf_avx512.c): 1..9 rows, and
    past one, two and four passes of 16 rows; dequantized rows by id and from any first row."""
    avx2, fast = _pair(qtype, n, k)
    assert fast.isa == "avx512" and avx2.isa == "avx2"
    for m in (*range(1, 10), 16, 21, 37, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert torch.equal(fast.mm(x), avx2.mm(x)), m
    assert torch.equal(fast.dequantize(), avx2.dequantize())
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(fast.dequantize_rows(ids), avx2.dequantize_rows(ids))
    first = n // 3
    rows = torch.empty(n - first, k)
    assert torch.equal(fast.dequantize_into(first, rows), avx2.dequantize()[first:])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(isa: str, qtype: str) -> None:
    weight = NativeWeight(from_blocks(qtype, _raw(qtype, 37, 160, seed=2), (37, 160)), isa)
    x = torch.randn(21, 160, generator=torch.Generator().manual_seed(0))
    together = weight.mm(x)
    for m in (1, 2, 4, 9):
        assert torch.equal(weight.mm(x[:m]), together[:m])
    for i in range(21):
        assert torch.equal(weight.mm(x[i : i + 1]), together[i : i + 1])


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_id_outside_the_weight_is_refused(isa: str) -> None:
    weight = NativeWeight(from_blocks("Q4_1", _raw("Q4_1", 20, 64, seed=0), (20, 64)), isa)
    with pytest.raises(ValueError, match="row ids outside"):
        weight.dequantize_rows(torch.tensor([3, 20]))
    with pytest.raises(ValueError, match=r"rows 15\.\.20 of 20"):
        weight.dequantize_into(15, torch.empty(6, 64))


@native
def test_the_avx512_kernels_are_chosen_where_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = from_blocks("Q8_0", _raw("Q8_0", 4, 32, seed=0), (4, 32))
    expected = "avx512" if kernels("avx512") is not None else "avx2"
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert NativeWeight(weight).isa == expected
    library = native_library()
    assert library is not None and library.isa == expected
    monkeypatch.setenv(KERNELS_ENV, "avx2")
    assert NativeWeight(weight).isa == "avx2"
