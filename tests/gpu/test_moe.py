"""MoE on a CUDA GPU: the fused-MoE Triton kernel against the torch reference path, and engine
greedy tokens against HF transformers on the same dummy weights.

Kernel: at the real expert shapes (Qwen3-30B-A3B's 128 × 2048 × 768, top 8, whole and one rank's
share of 8; Mixtral-8x7B's 8 × 4096 × 14336, top 2) from decode to prefill sizes. In bf16 its
error against a float32 evaluation of the same bf16 weights must be no worse than the torch
path's (it rounds less often); in float32 (IEEE dots) it equals the reference to float32
rounding; under a CUDA graph it computes the same as eagerly with new inputs copied in.

Engine: the two shapes with 4 layers (Qwen3-MoE with a dense first layer), dummy weights, against
HF's expert-by-expert ("eager") MoE. fp32:
every greedy token equals HF's, eagerly and from CUDA graphs. bf16: routing and kernels round
differently from HF's, so tokens may part at near-ties; each parting is printed (run with -s:
the divergence point to document) and, at the first parting token, HF's own bf16 logits must put
its token and ours within BF16_MAX_STEPS rounding steps of bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from attnserve import LLM
from attnserve.bench.moe import Setup, expert_spec, expert_weights, routed_inputs
from attnserve.model.layers.fused_moe import default_config, fused_experts
from attnserve.model.layers.fused_moe_decode import decode_experts
from attnserve.model.layers.ops import moe_reference
from attnserve.model.presets import preset_hf_config
from tests.gpu.reference import (
    ENGINE,
    NEW_TOKENS,
    Reference,
    bf16_spacing,
    build_reference,
    engine_tokens,
    first_difference,
)

pytestmark = pytest.mark.cuda

KERNEL_SHAPES = [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8), ("mixtral-8x7b", 1)]
BATCHES = (1, 7, 64, 256, 2048)


def _grouped(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The grouped GEMMs at every size (`fused_experts` without a config takes the decode path
    for a few pairs)."""
    return fused_experts(hidden, w13, w2, weights, ids, default_config(ids.numel(), w13.shape[0]))


KERNELS = {"grouped": _grouped, "decode": decode_experts}  # decode: batches 1 and 7 only
BF16_MAX_STEPS = 8
SMALL_MODELS = {
    "qwen3-moe-4-layers": ("qwen3-30b-a3b", {"num_hidden_layers": 4, "mlp_only_layers": [0]}),
    "mixtral-4-layers": ("mixtral-8x7b", {"num_hidden_layers": 4}),
}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("preset", "tp"), KERNEL_SHAPES, ids=lambda v: str(v))
def test_bf16_kernel_is_as_close_as_the_torch_path(
    preset: str, tp: int, batch: int, kernel: str
) -> None:
    if kernel == "decode" and batch > 8:
        pytest.skip("the decode path is for a few tokens")
    spec = expert_spec(preset, tp)
    inputs = routed_inputs(spec, expert_weights(spec, Setup()), batch, Setup())
    weights = inputs.weights.to(torch.bfloat16)  # Qwen3-MoE's rounding of the routing weights
    ours = KERNELS[kernel](inputs.hidden, inputs.w13, inputs.w2, weights, inputs.ids)
    torch_path = moe_reference(inputs.hidden, inputs.w13, inputs.w2, weights, inputs.ids)
    exact = moe_reference(
        inputs.hidden.float(), inputs.w13.float(), inputs.w2.float(), weights.float(), inputs.ids
    )
    ours_err, torch_err = _relative_error(ours, exact), _relative_error(torch_path, exact)
    print(f"{preset} tp{tp} batch {batch}: {kernel} {ours_err:.2e}, torch {torch_err:.2e}")
    assert ours.dtype == torch.bfloat16
    assert ours_err <= max(1.25 * torch_err, 1e-3)


@pytest.mark.parametrize(("preset", "tp"), KERNEL_SHAPES, ids=lambda v: str(v))
def test_fp32_kernel_equals_the_reference(preset: str, tp: int) -> None:
    setup = Setup(dtype=torch.float32)
    spec = expert_spec(preset, tp)
    inputs = routed_inputs(spec, expert_weights(spec, setup), 64, setup)
    args = (inputs.hidden, inputs.w13, inputs.w2, inputs.weights, inputs.ids)
    assert _relative_error(fused_experts(*args), moe_reference(*args)) < 1e-5


def test_kernel_replays_from_a_cuda_graph_with_new_routes() -> None:
    spec, setup = expert_spec("qwen3-30b-a3b"), Setup()
    weights = expert_weights(spec, setup)
    static = routed_inputs(spec, weights, 8, setup, seed=0)
    for _ in range(2):  # compiles and lazy set-up outside the capture
        fused_experts(static.hidden, *weights, static.weights, static.ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(static.hidden, *weights, static.weights, static.ids)
    for seed in (1, 2):
        new = routed_inputs(spec, weights, 8, setup, seed=seed)
        for buffer, value in zip(
            (static.hidden, static.weights, static.ids),
            (new.hidden, new.weights, new.ids),
            strict=True,
        ):
            buffer.copy_(value)
        graph.replay()
        expected = fused_experts(new.hidden, *weights, new.weights, new.ids)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> an HF directory holding only the config (the engine loads dummy weights)."""
    paths = {}
    for name, (preset, changes) in SMALL_MODELS.items():
        config = preset_hf_config(preset)
        for key, value in changes.items():
            setattr(config, key, value)
        path = tmp_path_factory.mktemp(name)
        config.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture(scope="module")
def references(small_models: dict[str, str]) -> Iterator[Callable[[str, str], Reference]]:
    """`references(model, dtype)`: HF on the model's dummy weights, built once (one kept)."""
    built: dict[tuple[str, str], Reference] = {}

    def get(model: str, dtype: str) -> Reference:
        if (model, dtype) not in built:
            built.clear()  # one HF model on the GPU at a time
            torch.cuda.empty_cache()
            built[(model, dtype)] = build_reference(dtype, small_models[model], "eager")
        return built[(model, dtype)]

    yield get
    built.clear()


def _tokens(
    path: str, dtype: str, enforce_eager: bool, prompts: list[list[int]]
) -> list[list[int]]:
    llm = LLM(path, dtype=dtype, enforce_eager=enforce_eager, **ENGINE)
    try:
        return engine_tokens(llm, prompts)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("model", list(SMALL_MODELS))
def test_fp32_tokens_equal_hf(
    model: str,
    enforce_eager: bool,
    small_models: dict[str, str],
    references: Callable[[str, str], Reference],
) -> None:
    reference = references(model, "float32")
    assert _tokens(small_models[model], "float32", enforce_eager, reference.prompts) == (
        reference.tokens
    )


@pytest.mark.parametrize("model", list(SMALL_MODELS))
def test_bf16_tokens_part_from_hf_only_at_near_ties(
    model: str, small_models: dict[str, str], references: Callable[[str, str], Reference]
) -> None:
    reference = references(model, "bfloat16")
    ours = _tokens(small_models[model], "bfloat16", False, reference.prompts)
    assert [len(tokens) for tokens in ours] == [NEW_TOKENS] * len(ours)
    partings, gaps = [], []
    for index, (mine, theirs) in enumerate(zip(ours, reference.tokens, strict=True)):
        step = first_difference(mine, theirs)
        if step is None:
            partings.append(f"prompt {index}: all {NEW_TOKENS} tokens equal")
            continue
        logits = reference.next_logits(index, step)
        gap = float(logits[theirs[step]] - logits[mine[step]])
        gaps.append(abs(gap) / bf16_spacing(float(logits[theirs[step]])))
        partings.append(f"prompt {index}: parts at token {step}, HF gap {gaps[-1]:.2f} steps")
    print(f"{model} bf16 vs HF: " + "; ".join(partings))
    assert all(gap <= BF16_MAX_STEPS for gap in gaps), "; ".join(partings)
