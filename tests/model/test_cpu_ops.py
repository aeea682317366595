"""The native CPU ops (`model.layers.cpu_ops`) against the layers' plain-torch path and, for
rope and SiLU, float64 formulas; and the layers taking them for float32 CPU tensors."""

from __future__ import annotations

import pytest
import torch

from attnserve.model.layers import cpu_ops, ops
from attnserve.model.layers.activation import SiluAndMul
from attnserve.model.layers.layernorm import RMSNorm
from attnserve.model.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    cpu_ops.cpu_ops_library() is None, reason="native CPU ops not built here (AVX2, compiler)"
)
TOL = {"atol": 2e-6, "rtol": 2e-6}


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 4, 16)])
def test_rms_norm_with_and_without_residual(shape: tuple[int, ...]) -> None:
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _rand(shape[-1], seed=1))
    x, residual = 3 * _rand(*shape, seed=2), _rand(*shape, seed=3)
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, norm.weight, 1e-5), ops.rms_norm_reference(x, norm.weight, 1e-5), **TOL
    )
    normed, summed = cpu_ops.fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(
        normed, ops.rms_norm_reference(x + residual, norm.weight, 1e-5), **TOL
    )
    assert torch.equal(norm(x), cpu_ops.rms_norm(x, norm.weight, 1e-5))  # the layer takes it


def test_rms_norm_of_a_strided_split() -> None:
    """Rows of a wider tensor (a split of a qkv output) need no copy to be normalised."""
    wide = _rand(5, 96, seed=4)
    part = wide[:, 32:96]
    weight = torch.ones(64)
    expected = part / part.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(cpu_ops.rms_norm(part, weight, 1e-6), expected, **TOL)


def test_rms_norm_per_head_of_strided_token_rows() -> None:
    """Qwen3's q/k norm: heads [T, H, D] of a qkv split (tokens a qkv row apart), no copy."""
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * _rand(16, seed=8))
    qkv = _rand(5, 4 * 16 + 2 * 32, seed=9)
    heads = qkv[:, :64].reshape(5, 4, 16)
    assert heads.data_ptr() == qkv.data_ptr()  # a view: the kernel reads it in place
    torch.testing.assert_close(
        norm(heads), ops.rms_norm_reference(heads.contiguous(), norm.weight, 1e-6), **TOL
    )


def test_rotary_embedding_against_the_formula() -> None:
    rope = RotaryEmbedding(16, 64, 10000.0)
    qkv = _rand(6, (4 + 2 + 2) * 16, seed=5)
    q, k = qkv[:, :64], qkv[:, 64:96]  # strided splits, as the model passes them
    positions = torch.tensor([0, 3, 7, 63, 1, 20])
    got_q, got_k = cpu_ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, 16)
    inv_freq = 1 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = positions[:, None].double() * inv_freq
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    for got, x in ((got_q, q), (got_k, k)):
        heads = x.double().reshape(6, -1, 16)
        first, second = heads[..., :8], heads[..., 8:]
        expected = torch.cat([first * cos - second * sin, second * cos + first * sin], -1)
        torch.testing.assert_close(got.double(), expected.flatten(1), atol=1e-5, rtol=1e-5)
    assert all(
        torch.equal(a, b) for a, b in zip(rope(positions, q, k), (got_q, got_k), strict=True)
    )


def test_rotary_embedding_of_qkv_copies_v_in_the_same_call() -> None:
    """`forward_qkv` on the CPU: q and k as `forward` rotates them, v's strided split copied to
    contiguous rows (the attention reads them; no torch copy runs in a decode step)."""
    rope = RotaryEmbedding(16, 64, 10000.0)
    qkv = _rand(6, (4 + 2 + 2) * 16, seed=7)
    q, k, v = qkv.split([64, 32, 32], -1)
    positions = torch.tensor([5, 0, 2, 9, 63, 4])
    got = rope.forward_qkv(positions, (q, k, v))
    assert all(t.is_contiguous() for t in got)
    assert torch.equal(got[2], v) and got[2].data_ptr() != v.data_ptr()
    for rotated, expected in zip(got[:2], rope(positions, q, k), strict=True):
        assert torch.equal(rotated, expected)


@pytest.mark.parametrize("inter", [40, 43])  # whole vectors of 8; a scalar tail
def test_silu_and_mul_against_the_formula(inter: int) -> None:
    x = 4 * _rand(3, 2 * inter, seed=6)
    x[0, :3] = torch.tensor([-100.0, 100.0, -88.0])  # past the vector exp's clamp
    gate, up = x.double().chunk(2, -1)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(cpu_ops.silu_and_mul(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(SiluAndMul()(x), cpu_ops.silu_and_mul(x))


def test_other_dtypes_keep_the_torch_path() -> None:
    x = torch.zeros(2, 4)
    assert not ops.use_native(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not ops.use_native(x, torch.zeros(2, 4, dtype=torch.bfloat16))  # a bfloat16 residual
    assert ops.use_native(x) and ops.use_native(x, x)
