"""Gemma's fused Triton kernels against the plain-torch definitions: the (1 + weight) RMSNorm
(plain, with the residual add, per head on a qkv split, folded into the q/k-norm rope launch)
and GeGLU (tanh GELU times up; their FP8 outputs: test_fp8_fusion); then a tiny Gemma 3 with every
layer on the kernels against HF transformers.

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

from attnserve.model.layers import fused_ops, fused_rotary  # noqa: E402
from attnserve.model.layers import ops as layer_ops  # noqa: E402
from attnserve.model.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

T, HIDDEN, Q_HEADS, KV_HEADS, HEAD = 5, 96, 4, 2, 32
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


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
    out = fused_ops.rms_norm(x, weight, EPS, unit_offset=True)
    assert out.dtype == dtype and out.shape == x.shape
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(x, weight, EPS, unit_offset=True))
    _assert_within_one_ulp(out.cpu(), _gemma_norm_float64(x.cpu(), weight.cpu()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_norm_with_residual_and_per_head(dtype: torch.dtype) -> None:
    x, residual = _rand(T, HIDDEN, dtype=dtype, seed=2), _rand(T, HIDDEN, dtype=dtype, seed=3)
    weight = 0.3 * _rand(HIDDEN, dtype=dtype, seed=4)
    out, summed = fused_ops.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(x + residual, weight, EPS, True))
    heads = _rand(T, 3 * HIDDEN, dtype=dtype, seed=5)[:, :HIDDEN].reshape(T, 3, HIDDEN // 3)
    head_weight = 0.3 * _rand(HIDDEN // 3, dtype=dtype, seed=6)
    out = fused_ops.rms_norm(heads, head_weight, EPS, unit_offset=True)
    _assert_within_one_ulp(out, layer_ops.rms_norm_reference(heads, head_weight, EPS, True))


def _gelu_tanh_and_mul_float64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().cpu().chunk(2, -1)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    return (0.5 * gate * (1 + torch.tanh(inner)) * up).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [40, 1500], ids=["one-block", "two-blocks"])
def test_gelu_tanh_and_mul_matches_torch_and_formula(dtype: torch.dtype, inter: int) -> None:
    x = 3 * _rand(T, 2 * inter, dtype=dtype, seed=7)
    out = fused_ops.gelu_tanh_and_mul(x)
    assert out.dtype == dtype and out.shape == (T, inter)
    gate, up = x.chunk(2, -1)
    torch_result = F.gelu(gate, approximate="tanh") * up
    # one rounding of the activation and one of the product: within two steps of torch's
    torch.testing.assert_close(out, torch_result, atol=1e-5, rtol=2 * torch.finfo(dtype).eps)
    torch.testing.assert_close(
        out.cpu(), _gelu_tanh_and_mul_float64(x), atol=1e-5, rtol=2 * torch.finfo(dtype).eps
    )


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
def gemma_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Route every layer through the Triton kernels (on CPU too), recording which ran."""
    calls: list[str] = []
    monkeypatch.setattr(layer_ops, "use_triton", lambda x: True)

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for module, name in (
        (fused_ops, "rms_norm"),
        (fused_ops, "fused_add_rms_norm"),
        (fused_ops, "gelu_tanh_and_mul"),
        (fused_rotary, "qkv_rotary_embedding"),
    ):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return calls


def test_gemma3_through_triton_matches_hf(gemma_kernels: list[str], tmp_path: Path) -> None:
    """End to end: a tiny Gemma 3 (1 + w norms around attention and the feed-forward block, q/k
    norms, GeGLU) with every layer on the kernels, a prefill then a paged decode step, against
    HF transformers in fp32."""
    if DEVICE != "cpu":
        pytest.skip("the parity harness runs the model on the CPU")
    import transformers

    from attnserve.model import ModelConfig
    from tests.model.paged import PagedRunner, load_reference_model
    from tests.model.test_gemma import MODELS, save_random_hf

    config_cls, settings = MODELS["Gemma3ForCausalLM"]
    hf_config = getattr(transformers, config_cls)(**{**settings, "num_hidden_layers": 2})
    hf_config.architectures = ["Gemma3ForCausalLM"]
    hf_model = save_random_hf(tmp_path, hf_config)
    config = ModelConfig.resolve(str(tmp_path), dtype="float32")
    model = load_reference_model(config)
    full = [[5, 17, 99, 3, 42, 7], [150, 2, 64, 11]]
    prompts, continuations = [seq[:-1] for seq in full], [seq[-1:] for seq in full]
    ours = PagedRunner(model, config, max_len=8, seqs=2).run(prompts, continuations)
    for seq, logits in zip(full, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert set(gemma_kernels) == {
        "rms_norm",
        "fused_add_rms_norm",
        "qkv_rotary_embedding",
        "gelu_tanh_and_mul",
    }
