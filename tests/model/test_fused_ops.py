"""The fused Triton kernels of `attnserve.model.layers.fused_ops` against the layers' plain-torch
path (and, for rope, SiLU, Gemma's (1 + weight) norm and GeGLU, an independent float64 formula),
then wired into the layers: a tiny Qwen3 and a tiny Gemma 3 with every layer on the kernels
against HF transformers (Gemma's norm also per head, with the residual add and folded into the
q/k-norm rope launch; the FP8-quantizing variants: test_fp8_fusion).

Runs on CUDA when present, else through the Triton interpreter on the CPU (tests/model/conftest
switches it on before the kernels are defined).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # already so via conftest; import-order proof
pytest.importorskip("triton")

from attnserve.model.layers import fused_ops as ops  # noqa: E402
from attnserve.model.layers import fused_rotary  # noqa: E402
from attnserve.model.layers import ops as layer_ops  # noqa: E402
from attnserve.model.layers.activation import SiluAndMul  # noqa: E402
from attnserve.model.layers.layernorm import RMSNorm  # noqa: E402
from attnserve.model.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq  # noqa: E402

T, HIDDEN, Q_HEADS, KV_HEADS, HEAD = 5, 64, 4, 2, 16
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
TOL: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _reference(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The layer's plain-torch norm of `x`."""
    return layer_ops.rms_norm_reference(x, norm.weight, norm.eps)


def _norm(size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(size, EPS).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * _rand(size, seed=9))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    norm, x = _norm(HIDDEN, dtype), 3 * _rand(T, HIDDEN, dtype=dtype)
    out = ops.rms_norm(x, norm.weight, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, _reference(norm, x), **TOL[dtype])


def test_rms_norm_odd_width_and_promotion() -> None:
    """A non-power-of-two row (masked tail) and torch's promotion of a float32 weight."""
    norm, x = _norm(40, torch.float32), _rand(3, 7, 40, dtype=torch.bfloat16)
    out = ops.rms_norm(x, norm.weight, EPS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, _reference(norm, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_rms_norm_on_a_qkv_split(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: [T, H, D] heads of the q slice of a qkv row (a strided view)."""
    norm = _norm(HEAD, dtype)
    qkv = _rand(T, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, seed=1)
    q = qkv[:, : Q_HEADS * HEAD].reshape(T, Q_HEADS, HEAD)
    assert not q.is_contiguous()
    out = ops.rms_norm(q, norm.weight, EPS)
    assert out.is_contiguous() and out.shape == q.shape
    torch.testing.assert_close(out, _reference(norm, q), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    norm = _norm(HIDDEN, dtype)
    x, residual = _rand(T, HIDDEN, dtype=dtype, seed=2), _rand(T, HIDDEN, dtype=dtype, seed=3)
    before = (x.clone(), residual.clone())
    out, summed = ops.fused_add_rms_norm(x, residual, norm.weight, EPS)
    expected_summed = x + residual
    # The sum is one rounding of the float32 sum to the dtype, exactly as torch's add.
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)
    torch.testing.assert_close(out, _reference(norm, expected_summed), **TOL[dtype])
    torch.testing.assert_close((x, residual), before, atol=0, rtol=0)


def _rope(dtype: torch.dtype) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rope module, positions [T], and q/k as strided splits of one qkv tensor."""
    with torch.device(DEVICE):
        rope = RotaryEmbedding(HEAD, max_position=64, base=10000.0)
    positions = torch.tensor([0, 3, 63, 17, 1], device=DEVICE)
    qkv = _rand(T, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, seed=4)
    q, k, _ = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
    return rope, positions, q, k


def _rope_float64(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Independent rotate-half rope: pair (i, i + D/2) rotated by position * inv_freq[i]."""
    angles = positions.double().cpu()[:, None] * rope_inv_freq(HEAD, 10000.0).double()[None]
    heads = x.double().cpu().view(x.shape[0], -1, HEAD)
    first, second = heads[..., : HEAD // 2], heads[..., HEAD // 2 :]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    out = torch.cat((first * cos - second * sin, second * cos + first * sin), -1)
    return out.flatten(1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_matches_torch_and_formula(dtype: torch.dtype) -> None:
    rope, positions, q, k = _rope(dtype)
    before = (q.clone(), k.clone())
    q_out, k_out = fused_rotary.rotary_embedding(positions, q, k, rope.cos_sin_cache, HEAD)
    q_ref, k_ref = rope(positions, q, k)
    for out, ref, x in ((q_out, q_ref, q), (k_out, k_ref, k)):
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, **TOL[dtype])
        expected = _rope_float64(positions, x).to(dtype)
        torch.testing.assert_close(out.cpu(), expected, **TOL[dtype])
    torch.testing.assert_close((q, k), before, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normed", [False, True], ids=["rope", "qk-norm-rope"])
def test_qkv_rotary_embedding_matches_the_separate_layers(dtype: torch.dtype, normed: bool) -> None:
    """One launch for q/k norm, rope and the copy of v, against the layers run one by one on a
    strided split of one qkv row (as the attention layer hands them over)."""
    rope, positions, _, _ = _rope(dtype)
    qkv = 3 * _rand(T, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, seed=4)
    q, k, v = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
    norms = (_norm(HEAD, dtype), _norm(HEAD, dtype)) if normed else None
    weights = None if norms is None else (norms[0].weight, norms[1].weight)
    got = fused_rotary.qkv_rotary_embedding(
        positions, (q, k, v), rope.cos_sin_cache, HEAD, weights, EPS
    )
    if norms is not None:
        q, k = (
            _reference(n, x.reshape(T, -1, HEAD)).flatten(1)
            for n, x in zip(norms, (q, k), strict=True)
        )
    expected = (*rope(positions, q, k), v)
    for out, ref in zip(got, expected, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(got[2], v, atol=0, rtol=0)


def _silu_and_mul_float64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().cpu().chunk(2, -1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def _gelu_tanh_and_mul_float64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().cpu().chunk(2, -1)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    return (0.5 * gate * (1 + torch.tanh(inner)) * up).to(x.dtype)


def _gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh") * up


GATED = {  # name: (kernel, the layer's plain torch, an independent float64 formula)
    "silu": ("silu_and_mul", SiluAndMul(), _silu_and_mul_float64),
    "gelu_tanh": ("gelu_tanh_and_mul", _gelu_tanh_and_mul_torch, _gelu_tanh_and_mul_float64),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [40, 1500], ids=["one-block", "two-blocks"])
@pytest.mark.parametrize("activation", list(GATED))
def test_gated_activation_matches_torch_and_formula(
    dtype: torch.dtype, inter: int, activation: str
) -> None:
    kernel, plain, formula = GATED[activation]
    x = 3 * _rand(T, 2 * inter, dtype=dtype, seed=5)
    out = getattr(ops, kernel)(x)
    assert out.dtype == dtype and out.shape == (T, inter)
    torch.testing.assert_close(out, plain(x), **TOL[dtype])
    torch.testing.assert_close(out.cpu(), formula(x), **TOL[dtype])


def test_empty_batch() -> None:
    norm, x = _norm(HIDDEN, torch.float32), _rand(0, HIDDEN)
    assert ops.rms_norm(x, norm.weight, EPS).shape == (0, HIDDEN)
    assert ops.fused_add_rms_norm(x, x, norm.weight, EPS)[1].shape == (0, HIDDEN)
    assert ops.silu_and_mul(_rand(0, 2 * HIDDEN)).shape == (0, HIDDEN)
    rope, _, _, _ = _rope(torch.float32)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    q, k = fused_rotary.rotary_embedding(
        empty, _rand(0, 64), _rand(0, 32), rope.cos_sin_cache, HEAD
    )
    assert q.shape == (0, 64) and k.shape == (0, 32)


def _gemma_norm_float64(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF's Gemma norm in float64, rounded to x's dtype once."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    return (normed * (1.0 + weight.double())).to(x.dtype)


def _assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or (bf16) one rounding step apart where the float32 value sat on a boundary."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp_min(1e-30)
    assert bool(((got.float() - want.float()).abs() <= ulp * 1.01 + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_norm_matches_torch(dtype: torch.dtype) -> None:
    x, weight = 3 * _rand(T, HIDDEN, dtype=dtype), 0.3 * _rand(HIDDEN, dtype=dtype, seed=1)
    out = ops.rms_norm(x, weight, EPS, unit_offset=True)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(x, weight, EPS, unit_offset=True))
    _assert_within_one_ulp(out.cpu(), _gemma_norm_float64(x.cpu(), weight.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_norm_with_residual_and_per_head(dtype: torch.dtype) -> None:
    x, residual = _rand(T, HIDDEN, dtype=dtype, seed=2), _rand(T, HIDDEN, dtype=dtype, seed=3)
    weight = 0.3 * _rand(HIDDEN, dtype=dtype, seed=4)
    out, summed = ops.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(x + residual, weight, EPS, True))
    heads = _rand(T, 2 * HIDDEN, dtype=dtype, seed=5)[:, :HIDDEN].reshape(T, 2, HIDDEN // 2)
    head_weight = 0.3 * _rand(HIDDEN // 2, dtype=dtype, seed=6)
    out = ops.rms_norm(heads, head_weight, EPS, unit_offset=True)
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(heads, head_weight, EPS, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_head_norms_fold_into_the_rope_launch(dtype: torch.dtype) -> None:
    """Gemma 3's q/k norm, rope and the copy of v in one launch against the norm and the rope
    run one by one on a strided split of one qkv row."""
    with torch.device(DEVICE):
        rope = RotaryEmbedding(HEAD, max_position=64, base=10000.0)
    positions = torch.tensor([0, 3, 63, 17, 1], device=DEVICE)
    qkv = 3 * _rand(T, (Q_HEADS + 2 * KV_HEADS) * HEAD, dtype=dtype, seed=9)
    q, k, v = qkv.split([Q_HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
    weights = (0.3 * _rand(HEAD, dtype=dtype, seed=10), 0.3 * _rand(HEAD, dtype=dtype, seed=11))
    got = fused_rotary.qkv_rotary_embedding(
        positions, (q, k, v), rope.cos_sin_cache, HEAD, weights, EPS, unit_offset=True
    )
    q, k = (
        layer_ops.rms_norm_reference(x.reshape(T, -1, HEAD), w, EPS, True).flatten(1)
        for w, x in zip(weights, (q, k), strict=True)
    )
    expected = (*rope(positions, q, k), v)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for out, ref in zip(got, expected, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, **tol)


@pytest.fixture
def triton_layers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route every layer through `fused_ops` (on CPU too), recording which kernels ran."""
    calls: list[str] = []
    monkeypatch.setattr(layer_ops, "use_triton", lambda x: True)

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    kernels = {
        ops: ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul"),
        fused_rotary: ("rotary_embedding", "qkv_rotary_embedding"),
    }
    for module, names in kernels.items():
        for name in names:
            monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return calls


def test_layers_dispatch_to_triton(triton_layers: list[str]) -> None:
    norm, x = _norm(HIDDEN, torch.bfloat16), _rand(T, HIDDEN, dtype=torch.bfloat16)
    torch.testing.assert_close(norm(x), _reference(norm, x), **TOL[torch.bfloat16])
    normed, summed = norm.forward_with_residual(x, x)
    torch.testing.assert_close(summed, x + x, atol=0, rtol=0)
    torch.testing.assert_close(normed, _reference(norm, x + x), **TOL[torch.bfloat16])
    rope, positions, q, k = _rope(torch.float32)
    q_out, _ = rope(positions, q, k)
    torch.testing.assert_close(
        q_out, _rope_float64(positions, q).float().to(DEVICE), **TOL[q.dtype]
    )
    SiluAndMul()(x)
    assert triton_layers == ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"]


def _assert_paged_logits_match_hf(hf_model: Any, path: Path) -> None:
    """The model saved at `path`, run by the engine's layers (a prefill then a paged decode
    step), gives HF's fp32 logits at every position."""
    from attnserve.model import ModelConfig
    from tests.model.paged import PagedRunner, load_reference_model

    config = ModelConfig.resolve(str(path), dtype="float32")
    model = load_reference_model(config)
    full = [[5, 17, 99, 3, 42, 7], [150, 2, 64, 11]]
    prompts, continuations = [seq[:-1] for seq in full], [seq[-1:] for seq in full]
    ours = PagedRunner(model, config, max_len=8, seqs=2).run(prompts, continuations)
    for seq, logits in zip(full, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_qwen3_through_triton_matches_hf(triton_layers: list[str], tmp_path: Path) -> None:
    """End to end: a tiny Qwen3 (q/k norm, residual norms, rope, SiLU) with every layer on the
    Triton kernels against HF transformers in fp32 (a short version of test_hf_parity's case:
    the interpreter runs programs one by one)."""
    if DEVICE != "cpu":
        pytest.skip("the parity harness runs the model on the CPU")
    from tests.model.test_hf_parity import CASES, _save_hf_model

    _assert_paged_logits_match_hf(_save_hf_model(tmp_path, *CASES["qwen3-qknorm"]), tmp_path)
    assert set(triton_layers) == {
        "rms_norm",
        "fused_add_rms_norm",
        "qkv_rotary_embedding",
        "silu_and_mul",
    }


def test_gemma3_through_triton_matches_hf(triton_layers: list[str], tmp_path: Path) -> None:
    """End to end: a tiny Gemma 3 (1 + w norms around attention and the feed-forward block, q/k
    norms, GeGLU) with every layer on the kernels against HF transformers in fp32."""
    if DEVICE != "cpu":
        pytest.skip("the parity harness runs the model on the CPU")
    import transformers

    from tests.model.test_gemma import MODELS, save_random_hf

    config_cls, settings = MODELS["Gemma3ForCausalLM"]
    hf_config = getattr(transformers, config_cls)(**{**settings, "num_hidden_layers": 2})
    hf_config.architectures = ["Gemma3ForCausalLM"]
    _assert_paged_logits_match_hf(save_random_hf(tmp_path, hf_config), tmp_path)
    assert set(triton_layers) == {
        "rms_norm",
        "fused_add_rms_norm",
        "qkv_rotary_embedding",
        "gelu_tanh_and_mul",
    }
