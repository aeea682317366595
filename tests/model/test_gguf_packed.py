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
from attnserve.model.quantization.gguf_cpu import native_dequantize, native_library, native_mm
from attnserve.model.quantization.gguf_torch import TorchPackedWeight

TYPES = ("Q4_0", "Q4_1", "Q8_0")
SHAPES = [(16, 32), (7, 96), (33, 160), (100, 64), (1, 32)]  # (N, K): N is not a multiple of 16
ROWS = (1, 3, 5, NATIVE_MAX_ROWS + 9)  # a tile of 4 and a remainder; past the native limit
native = pytest.mark.skipif(native_library() is None, reason="no AVX2 CPU or C compiler here")


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
    if native_library() is not None:
        assert torch.equal(native_dequantize(weight), expected)


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
    scale = blocks.abs().amax(-1, keepdim=True) / 32767
    rounded = torch.round(blocks / torch.where(scale > 0, scale, 1)) * scale
    c = torch.from_numpy(_sum_factors(qtype, raw, n, k))
    weight = _dequantized(qtype, raw)
    sums_gap = blocks.sum(-1) - rounded.sum(-1)  # exact sums in the kernel, rounded ones here
    reference = rounded.view(m, k) @ weight.t() + sums_gap @ c.t()
    # |x - rounded| <= scale / 2 per element, times |w - c| summed over the block
    codes_part = (weight - c.repeat_interleave(32, dim=1)).abs().view(n, k // 32, 32).sum(-1)
    bound = (scale.squeeze(-1) / 2) @ codes_part.t()
    return reference, bound


@native
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [r for r in ROWS if r <= NATIVE_MAX_ROWS])
def test_native_kernel_against_rounded_reference(qtype: str, n: int, k: int, m: int) -> None:
    raw = _raw(qtype, n, k, seed=7 * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = native_mm(x, from_blocks(qtype, raw, (n, k))).double()
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
    if native_library() is not None and m > NATIVE_MAX_ROWS:
        torch.testing.assert_close(PackedSegment(weight).mm(x).double(), exact, **tolerance)


@native
def test_segment_picks_the_blas_path_past_the_native_limit() -> None:
    raw = _raw("Q8_0", 40, 64, seed=1)
    segment = PackedSegment(from_blocks("Q8_0", raw, (40, 64)))
    x = torch.randn(NATIVE_MAX_ROWS + 1, 64)
    exact = x.double() @ _dequantized("Q8_0", raw).t()
    # the dequantized weight through the BLAS: float32 rounding only, far below the int16 bound
    assert (segment.mm(x).double() - exact).abs().max() < 1e-5 * exact.abs().max()


def test_gguf_weight_rows_and_shape() -> None:
    weight = GGUFWeight("Q8_0", torch.zeros(6, 2, 34, dtype=torch.uint8))
    assert weight.shape == (6, 64) and weight.get_shape() == [6, 64]
    assert weight.rows(lambda t: t[:3]).shape == (3, 64)
    with pytest.raises(ValueError, match="not kept quantized"):
        from_blocks("Q6_K", np.zeros(10, dtype=np.uint8), (1, 256))
