"""The MoE layer: its router and torch path against HF transformers' own sparse MoE blocks on the
same weights, and the fused-MoE Triton kernels against that torch path (and a float64 formula).

The kernels run on CUDA when present, else through the Triton interpreter on the CPU (tests/model
conftest switches it on before the kernels are defined). The interpreter multiplies bf16 as raw
integers, so on the CPU the low-precision case is float16; bf16 is checked on the GPU
(tests/gpu/test_moe.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import transformers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # already so via conftest; import-order proof
pytest.importorskip("triton")

from attnserve.model.layers import ops  # noqa: E402
from attnserve.model.layers.fused_moe import (  # noqa: E402
    MoEKernelConfig,
    default_config,
    fused_experts,
)
from attnserve.model.layers.fused_moe_decode import DecodeMoEConfig, decode_experts  # noqa: E402
from attnserve.model.layers.fused_moe_routing import (  # noqa: E402
    TRITON_ALIGN_MAX_PAIRS,
    AlignedRoutes,
    align_with_torch,
    align_with_triton,
    fused_topk,
)
from attnserve.model.layers.moe import MoESpec, SparseMoeBlock  # noqa: E402
from attnserve.model.layers.ops import moe_reference, select_experts  # noqa: E402

HIDDEN, INTER, EXPERTS = 64, 48, 8
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
SMALL_TILES = MoEKernelConfig(16, 16, 16, group_m=2)


def _rand(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)


def _routes(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts per token (expert 1 never chosen) and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e != 1])
    ids = torch.stack(
        [allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


def _float64_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, in float64: Σ_k weight · w2[e] (silu(gate_e x) · up_e x)."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, expert in enumerate(ids[t].tolist()):
            gate, up = (w13[expert] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (w2[expert] @ (torch.nn.functional.silu(gate) * up))
    return out


def _check_routes(routes: AlignedRoutes, ids: torch.Tensor, experts: int, block_m: int) -> None:
    """Every pair once, each block holds pairs of its expert only (in pair order, padding at the
    end of a run), each run padded to whole blocks."""
    pairs, padded = ids.numel(), int(routes.num_padded)
    sorted_pairs = routes.sorted_pairs.tolist()
    assert sorted(p for p in sorted_pairs if p < pairs) == list(range(pairs))
    assert all(p == pairs for p in sorted_pairs[padded:])
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    flat = ids.flatten().tolist()
    for block, expert in enumerate(routes.block_experts.tolist()[: padded // block_m]):
        rows = sorted_pairs[block * block_m : (block + 1) * block_m]
        real = [p for p in rows if p < pairs]
        assert real and all(flat[p] == expert for p in real)
        assert rows[: len(real)] == real == sorted(real)
    assert len(sorted_pairs) >= padded and len(sorted_pairs) % block_m == 0
    assert len(routes.block_experts) == len(sorted_pairs) // block_m


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [
        (1, 2, 6, 16),
        (9, 2, 6, 4),
        (37, 8, 128, 16),
        (5, 1, 3, 64),
        (TRITON_ALIGN_MAX_PAIRS // 8, 8, 128, 16),
    ],
)
def test_triton_and_torch_sorts_agree(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    _, ids = _routes(tokens, top_k, experts, seed=tokens)
    torch_routes = align_with_torch(ids, experts, block_m)
    _check_routes(torch_routes, ids, experts, block_m)
    triton_routes = align_with_triton(ids.to(torch.int32), experts, block_m)
    for name in ("sorted_pairs", "block_experts", "num_padded"):
        torch.testing.assert_close(getattr(triton_routes, name), getattr(torch_routes, name))


def test_the_triton_sort_refuses_too_many_pairs() -> None:
    ids = torch.zeros(TRITON_ALIGN_MAX_PAIRS + 1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        align_with_triton(ids, 4, 16)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16], ids=str)
def test_fused_topk_matches_select_experts(renormalize: bool, weights_dtype: torch.dtype) -> None:
    logits = _rand(13, 40, scale=2.0, seed=3)[:, :37]  # a strided view, 37 (padded) experts
    weights, ids = fused_topk(logits, 5, renormalize, weights_dtype)
    want_weights, want_ids = select_experts(logits, 5, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == weights_dtype
    torch.testing.assert_close(ids.long(), want_ids, atol=0, rtol=0)
    torch.testing.assert_close(weights, want_weights.to(weights_dtype), **TOL[weights_dtype])


def test_fused_topk_takes_the_lowest_id_among_equals() -> None:
    weights, ids = fused_topk(torch.zeros(2, 6, device=DEVICE), 3, True, torch.float32)
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3, device=DEVICE))
    with pytest.raises(ValueError, match="top_k 7"):
        fused_topk(torch.zeros(2, 6, device=DEVICE), 7, True, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "config"),
    [(1, 2, None), (5, 1, SMALL_TILES), (13, 3, SMALL_TILES), (13, 3, None)],
)
def test_kernel_matches_reference(
    dtype: torch.dtype, tokens: int, top_k: int, config: MoEKernelConfig | None
) -> None:
    """Decode and prefill sizes; small tiles cover several row, column and K blocks, masked
    tails (48 = 3 × 16 but H, I not multiples of the default tiles) and the grouped order."""
    x = _rand(tokens, HIDDEN, seed=1).to(dtype)
    w13 = _rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.15, seed=2).to(dtype)
    w2 = _rand(EXPERTS, HIDDEN, INTER, scale=0.15, seed=4).to(dtype)
    weights, ids = _routes(tokens, top_k, EXPERTS, seed=tokens)
    out = fused_experts(x, w13, w2, weights, ids, config)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), **TOL[dtype])
    expected = _float64_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("tokens", "top_k", "config"),
    [
        (
            1,
            3,
            DecodeMoEConfig(32, 32, 16, 32, num_warps=2),
        ),  # masked column tails, several K tiles
        (4, 2, DecodeMoEConfig(16, 16, 64, 16)),
        (8, 4, None),
    ],
)
def test_decode_kernels_match_reference(
    tokens: int, top_k: int, config: DecodeMoEConfig | None, weights_dtype: torch.dtype
) -> None:
    """The matrix-vector path for decode sizes against
    the torch path and the float64 formula, with Qwen3-MoE's (model dtype) and Mixtral's (float32)
    routing weights."""
    x = _rand(tokens, HIDDEN, seed=1).half()
    w13 = _rand(EXPERTS, 2 * INTER, HIDDEN, scale=0.15, seed=2).half()
    w2 = _rand(EXPERTS, HIDDEN, INTER, scale=0.15, seed=4).half()
    weights, ids = _routes(tokens, top_k, EXPERTS, seed=tokens + 7)
    weights = weights.to(weights_dtype)
    out = decode_experts(x, w13, w2, weights, ids, config)
    assert out.dtype == torch.float16 and out.shape == x.shape
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), **TOL[torch.float16])
    expected = _float64_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float16])
    with pytest.raises(ValueError, match="block_k_down must be a power of two"):
        DecodeMoEConfig(block_k_down=48)


def test_kernel_edge_cases() -> None:
    w13 = _rand(EXPERTS, 2 * INTER, HIDDEN, seed=2)
    w2 = _rand(EXPERTS, HIDDEN, INTER, seed=4)
    no_routes = torch.empty(0, 2, device=DEVICE), torch.empty(0, 2, dtype=torch.long, device=DEVICE)
    empty = fused_experts(_rand(0, HIDDEN), w13, w2, *no_routes)
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="do not match"):
        fused_experts(_rand(3, HIDDEN + 1), w13, w2, *_routes(3, 2, EXPERTS, seed=0))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        MoEKernelConfig(16, 24, 32)


def test_default_config_grows_with_pairs_per_expert() -> None:
    rows = [default_config(pairs, 128).block_m for pairs in (8, 1024, 4096, 16384, 65536)]
    assert rows == sorted(rows) and rows[0] == 16 and rows[-1] == 128


def _hf_block(config_cls: str, **settings: Any) -> Any:
    common = {"hidden_size": HIDDEN, "num_hidden_layers": 1, "num_attention_heads": 4}
    config = getattr(transformers, config_cls)(**common, **settings)
    module = transformers.models.qwen3_moe.modeling_qwen3_moe
    if config_cls == "MixtralConfig":
        module = transformers.models.mixtral.modeling_mixtral
    block_cls = next(getattr(module, n) for n in dir(module) if n.endswith("SparseMoeBlock"))
    torch.manual_seed(0)
    block = block_cls(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.3 * torch.randn_like(param))
    return block


HF_BLOCKS = {
    "qwen3-norm": (
        "Qwen3MoeConfig",
        {"num_experts": EXPERTS, "num_experts_per_tok": 3, "moe_intermediate_size": INTER},
        MoESpec(EXPERTS, 3, HIDDEN, INTER, renormalize=True, weights_in_model_dtype=True),
    ),
    "qwen3-plain": (
        "Qwen3MoeConfig",
        {"num_experts": EXPERTS, "num_experts_per_tok": 3, "moe_intermediate_size": INTER},
        MoESpec(EXPERTS, 3, HIDDEN, INTER, renormalize=False, weights_in_model_dtype=True),
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": INTER},
        MoESpec(4, 2, HIDDEN, INTER, renormalize=True, weights_in_model_dtype=False),
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("case", list(HF_BLOCKS))
def test_block_matches_hf(case: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    config_cls, settings, spec = HF_BLOCKS[case]
    settings = {**settings, "norm_topk_prob": spec.renormalize} if "qwen3" in case else settings
    hf_block = _hf_block(config_cls, **settings)
    ours = SparseMoeBlock(spec)
    ours.load_state_dict(hf_block.state_dict())
    monkeypatch.setattr(ops, "use_triton", lambda x: fused)
    x = _rand(11, HIDDEN, seed=5).cpu()
    with torch.no_grad():
        expected = hf_block(x[None])[0]
        got = ours.to(DEVICE)(x.to(DEVICE)).cpu()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
