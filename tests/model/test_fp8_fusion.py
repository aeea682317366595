"""FP8 layers take their input quantized by the op before them (issue 30): the fused RMSNorm
(Llama's and Gemma's) and gated-activation (SiLU, GeGLU) kernels that end in per-row
quantization, the wiring of decoder layers, and the Triton FP8 GEMM (row-wise scales, split over
K or not; block-wise ones) under the interpreter.

The interpreter's E4M3 cast rounds some values wrongly, by up to a binade (tests/gpu/test_fp8.py
compares the kernels' bits on the GPU): here the scales (each row's max, exact) and the residual
sums are compared exactly, the quantized values by sign and within a factor of two.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # already so via conftest; import-order proof
pytest.importorskip("triton")

from attnserve.model import ModelConfig
from attnserve.model.layers import fused_ops
from attnserve.model.layers import ops as layer_ops
from attnserve.model.quantization import fp8_gemm
from attnserve.model.quantization.fp8 import quantize_rows
from attnserve.model.quantization.fp8_format import Fp8Activation
from tests.model.paged import PagedRunner, load_reference_model

# the kernels on CPU tensors run under the interpreter only; tests/gpu/test_fp8.py runs them on cuda
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs on the GPU here")


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).bfloat16()


def _assert_quantized_like(got: Fp8Activation, expected: torch.Tensor) -> None:
    """`got` holds `expected` (bf16 rows) quantized per row, as the interpreter casts it."""
    values, scale = quantize_rows(expected)
    assert got.values.dtype == values.dtype and got.values.shape == values.shape
    assert torch.equal(got.scale, scale)
    got_values, reference = got.values.float(), values.float()
    assert bool((got_values * reference >= 0).all())  # no sign flips (tiny values may be 0)
    assert bool(((got_values - reference).abs() <= reference.abs()).all())


@interpreted
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_quantized_norm_is_the_norm_then_its_quantization(
    with_residual: bool, unit_offset: bool
) -> None:
    x, residual, weight = _rand(7, 96), _rand(7, 96, seed=1), 1.0 + 0.1 * _rand(96, seed=2)
    given = residual if with_residual else None
    got, summed = fused_ops.rms_norm_fp8(x, given, weight, 1e-6, unit_offset)
    if with_residual:
        normed, expected_sum = layer_ops.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset)
        assert summed is not None and torch.equal(summed, expected_sum)
    else:
        normed = layer_ops.rms_norm(x, weight, 1e-6, unit_offset)
        assert summed is None
    _assert_quantized_like(got, normed)


@interpreted
@pytest.mark.parametrize(
    "quantized, plain",
    [
        (fused_ops.silu_and_mul_fp8, layer_ops.silu_and_mul),
        (fused_ops.gelu_tanh_and_mul_fp8, layer_ops.gelu_tanh_and_mul),
    ],
    ids=["silu", "gelu_tanh"],
)
def test_the_quantized_activation_is_the_activation_then_its_quantization(
    quantized: Any, plain: Any
) -> None:
    x = _rand(5, 2 * 1500)  # a row wider than the unquantized kernel's 1,024-wide chunks
    _assert_quantized_like(quantized(x), plain(x))


@interpreted
def test_a_quantized_norm_refuses_rows_it_cannot_quantize() -> None:
    with pytest.raises(ValueError, match="quantized RMSNorm"):
        fused_ops.rms_norm_fp8(_rand(2, 3, 16), None, torch.ones(16).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="quantized RMSNorm"):
        fused_ops.rms_norm_fp8(_rand(2, 16), None, torch.ones(16), 1e-6)  # float32 weight


def _model(path: Path, quantization: str | None) -> tuple[torch.nn.Module, ModelConfig]:
    config = ModelConfig.resolve(str(path), dtype="float32", quantization=quantization)
    return load_reference_model(config), config


def _fusing_ops(model: torch.nn.Module) -> list[bool]:
    return [module.output_fp8 for module in model.modules() if hasattr(module, "output_fp8")]


def _assert_fused_equals_unfused(model: torch.nn.Module, config: ModelConfig) -> None:
    """A prompt's logits are the same with the ops quantizing for their projections and with
    the projections quantizing their input themselves."""
    prompt = [5, 17, 99, 3, 42, 7, 150, 2]
    fused = PagedRunner(model, config, max_len=16, seqs=1).step([prompt])[0]
    for module in model.modules():
        if hasattr(module, "output_fp8"):
            module.output_fp8 = False
    unfused = PagedRunner(model, config, max_len=16, seqs=1).step([prompt])[0]
    assert torch.equal(fused, unfused)


def test_fp8_decoder_layers_quantize_in_the_norms_and_the_activation(tiny_llama_dir: Path) -> None:
    """Each layer's input norm, post-attention norm and SiLU-and-mul hand their FP8 projection
    its input quantized, and the model computes exactly what it computes when the projections
    quantize it themselves (the first layer's norm has no residual to add)."""
    model, config = _model(tiny_llama_dir, "fp8")
    layers = len(model.model.layers)
    fusing = _fusing_ops(model)
    assert fusing.count(True) == 3 * layers and fusing.count(False) == 1  # the final norm
    _assert_fused_equals_unfused(model, config)


def test_unquantized_layers_take_float_input(tiny_llama_dir: Path) -> None:
    model, _ = _model(tiny_llama_dir, None)
    assert not any(_fusing_ops(model))


def test_gemma_norms_and_geglu_quantize_for_their_projections(tmp_path: Path) -> None:
    """Gemma's (1 + weight) input and pre-feed-forward norms and its GeGLU hand their FP8
    projections the input quantized, computing exactly what the projections would; its
    post-attention and post-feed-forward norms feed no projection and never quantize."""
    from tests.model.test_hf_parity import CASES, _save_hf_model

    _save_hf_model(tmp_path, *CASES["gemma2-softcap-sliding"])
    model, config = _model(tmp_path, "fp8")
    layers = len(model.model.layers)
    fusing = _fusing_ops(model)
    assert fusing.count(True) == 3 * layers and fusing.count(False) == 2 * layers + 1
    _assert_fused_equals_unfused(model, config)


def _rounded_operands(m: int, n: int, k: int, group: int | None) -> tuple[torch.Tensor, ...]:
    """E4M3 a [m, k], b [n, k] and their scales (per row, or per row and group of columns)."""
    a, b = _rand(m, k, seed=3).float(), _rand(n, k, seed=4).float()
    width = k if group is None else group
    a_q, a_scale = quantize_rows(a.reshape(-1, width))
    b_q, b_scale = quantize_rows(b.reshape(-1, width))
    return a_q.reshape(m, k), a_scale.reshape(m, -1), b_q.reshape(n, k), b_scale.reshape(n, -1)


def _dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, width = values.shape
    grouped = values.double().reshape(rows, scale.shape[1], -1) * scale.double()[:, :, None]
    return grouped.reshape(rows, width)


@interpreted
@pytest.mark.parametrize("group", [None, 64])
@pytest.mark.parametrize(("m", "n"), [(5, 40), (33, 64)])
def test_triton_fp8_gemm_is_the_product_of_its_scaled_operands(
    m: int, n: int, group: int | None
) -> None:
    a, a_scale, b, b_scale = _rounded_operands(m, n, 256, group)
    config = fp8_gemm.GemmConfig(16, 32, 64, 4, 2, group_m=2)  # tiles past M and N: masked
    got = fp8_gemm.scaled_mm(a, a_scale.squeeze(1), b, b_scale.squeeze(1), torch.float32,
                             group=group, config=config)  # fmt: skip
    expected = _dequantized(a, a_scale) @ _dequantized(b, b_scale).t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("group", [None, 64])
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize(("m", "n"), [(5, 40), (33, 64)])
def test_split_k_fp8_gemm_is_the_product_of_its_scaled_operands(
    m: int, n: int, split: int, group: int | None
) -> None:
    """Each program sums a slice of K into a float32 workspace (group-wise: each K block scaled
    by its own group's scales, the slice's groups, not the first ones); a second launch adds the
    slices (row-wise: and scales the sum per row and column): the product of the scaled
    operands."""
    a, a_scale, b, b_scale = _rounded_operands(m, n, 512, group)
    config = fp8_gemm.GemmConfig(16, 32, 64, 4, 2, group_m=2, split_k=split)
    got = fp8_gemm.scaled_mm(a, a_scale.squeeze(1), b, b_scale.squeeze(1), torch.float32,
                             group=group, config=config)  # fmt: skip
    expected = _dequantized(a, a_scale) @ _dequantized(b, b_scale).t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize(("group", "row_multiple"), [(64, 1), (48, 4)])
def test_groups_quantize_as_rows_of_a_group_with_column_major_scales(
    group: int, row_multiple: int
) -> None:
    """One program a row quantizes each group of its columns as `quantize_rows` quantizes a row
    of that group (groups of 48: padded to 64 inside the kernel); rows up to the multiple are
    zero with the smallest scale; the scales are column-major, as cuBLAS reads them."""
    from attnserve.model.quantization import fp8_quant
    from attnserve.model.quantization.fp8_format import MIN_SCALE

    x = _rand(5, 4 * group)
    values, scale = fp8_quant.quantize_groups(x, group, row_multiple)
    rows = 8 if row_multiple == 4 else 5
    assert values.shape == (rows, 4 * group) and scale.shape == (rows, 4)
    assert scale.stride() == (1, rows)
    _assert_quantized_like(
        Fp8Activation(values[:5].reshape(-1, group), scale[:5].reshape(-1)), x.reshape(-1, group)
    )
    assert not values[5:].float().any() and bool((scale[5:] == MIN_SCALE).all())


@interpreted
def test_the_group_scaled_gemm_reads_column_major_scales() -> None:
    from attnserve.model.quantization import fp8_quant

    a = _rand(6, 256, seed=3).float()
    values, a_scale = fp8_quant.quantize_groups(a, 64)
    _, _, b, b_scale = _rounded_operands(6, 40, 256, 64)
    config = fp8_gemm.group_config(6, 40, 256, 64)
    assert config.block_k <= 64 and 64 % config.block_k == 0
    got = fp8_gemm.scaled_mm(values, a_scale, b, b_scale, torch.float32, group=64, config=config)
    expected = _dequantized(values, a_scale) @ _dequantized(b, b_scale).t()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@interpreted
def test_triton_fp8_gemm_refuses_a_k_off_its_blocks() -> None:
    a, a_scale, b, b_scale = _rounded_operands(4, 32, 96, None)
    with pytest.raises(ValueError, match="K=96"):
        fp8_gemm.scaled_mm(a, a_scale, b, b_scale, torch.float32,
                           config=fp8_gemm.GemmConfig(16, 32, 64, 4, 2))  # fmt: skip
    a, a_scale, b, b_scale = _rounded_operands(4, 32, 256, None)
    with pytest.raises(ValueError, match="K=256"):  # 4 slices of whole 128-column blocks: 512+
        fp8_gemm.scaled_mm(a, a_scale, b, b_scale, torch.float32,
                           config=fp8_gemm.GemmConfig(16, 32, 128, 4, 2, split_k=4))  # fmt: skip
    a, a_scale, b, b_scale = _rounded_operands(4, 32, 256, 64)
    with pytest.raises(ValueError, match="group 64"):  # K blocks must not straddle two groups
        fp8_gemm.scaled_mm(a, a_scale, b, b_scale, torch.float32, group=64,
                           config=fp8_gemm.GemmConfig(16, 32, 128, 4, 2))  # fmt: skip


def test_picked_tiles_cover_k_in_whole_blocks_up_to_256_rows() -> None:
    """`pick_config` takes the Triton GEMM up to 256 rows only, and every tile it picks covers
    K in whole blocks of every slice (FP8 linear sizes are multiples of 16; others go to
    torch's GEMM)."""
    sizes = (1024, 1040, 2048, 3072, 4096, 5120, 6144, 12288, 14336, 25600, 28672)
    for m, n, k in itertools.product((1, 7, 16, 33, 64, 100, 128, 200, 256), sizes, sizes):
        config = fp8_gemm.pick_config(m, n, k)
        if config is not None:
            assert k % (config.block_k * config.split_k) == 0, (m, n, k, config)
            assert k // config.split_k >= 1024, (m, n, k, config)
    assert fp8_gemm.pick_config(257, 4096, 4096) is None
