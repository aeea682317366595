"""Tensor parallelism of the MoE layer: every expert's intermediate dimension split over the ranks.

One simulated rank at a time: each rank's shard, loaded from any checkpoint form (HF's stacked
tensor, one expert's projection, a lazy safetensors slice), gives a partial output, and the
partials sum to the full layer's output; dummy weights do not depend on the degree. Then end to
end on CPU (gloo, one process per rank): greedy tokens at TP=2 equal HF transformers' on tiny
Qwen3-MoE and Mixtral checkpoints (read lazily, each rank only its slices), and TP=1's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attnserve import SamplingParams
from attnserve.model.config import ModelConfig
from attnserve.model.layers import moe
from attnserve.model.layers.moe import FusedMoE
from attnserve.model.layers.ops import moe_reference, select_experts
from attnserve.model.loader import build_model
from attnserve.model.weights import init_dummy_weights
from tests.conftest import hf_greedy
from tests.distributed.test_parallel_layers import as_rank
from tests.distributed.test_tensor_parallel import random_prompts, token_ids
from tests.model.tiny_moe import save_tiny_moe

EXPERTS, HIDDEN, INTER = 4, 8, 12


@pytest.fixture
def full_weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen),
        torch.randn(EXPERTS, HIDDEN, INTER, generator=gen),
    )


def _load_stacked(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, _: Path) -> None:
    layer.weight_loader(layer.gate_up_proj, w13)
    layer.weight_loader(layer.down_proj, w2)


def _load_per_expert(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, _: Path) -> None:
    for expert in range(EXPERTS):
        gate, up = w13[expert].chunk(2)
        layer.weight_loader(layer.gate_up_proj, gate, "gate", expert)
        layer.weight_loader(layer.gate_up_proj, up, "up", expert)
        layer.weight_loader(layer.down_proj, w2[expert], "down", expert)


def _load_lazy_per_expert(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, tmp: Path) -> None:
    tensors = {}
    for expert in range(EXPERTS):
        gate, up = w13[expert].chunk(2)
        tensors |= {f"{expert}.gate": gate, f"{expert}.up": up, f"{expert}.down": w2[expert]}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "experts.safetensors"))
    with safe_open(str(tmp / "experts.safetensors"), framework="pt") as handle:
        for expert in range(EXPERTS):
            for shard in ("gate", "up"):
                slice_ = handle.get_slice(f"{expert}.{shard}")
                layer.weight_loader(layer.gate_up_proj, slice_, shard, expert)
            layer.weight_loader(layer.down_proj, handle.get_slice(f"{expert}.down"), None, expert)


LOADERS = {"stacked": _load_stacked, "per-expert": _load_per_expert, "lazy": _load_lazy_per_expert}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_expert_shards_sum_to_the_full_output(
    loader: str,
    full_weights: tuple[torch.Tensor, torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setattr(moe, "tensor_model_parallel_all_reduce", lambda t: t)
    w13, w2 = full_weights
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(torch.randn(5, EXPERTS), 2, renormalize=True)
    partials = []
    for rank in range(2):
        with as_rank(2, rank):
            layer = FusedMoE(EXPERTS, HIDDEN, INTER)
        LOADERS[loader](layer, w13, w2, tmp_path)
        rows = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        gate, up = w13.chunk(2, dim=1)
        torch.testing.assert_close(layer.gate_up_proj, torch.cat([gate[:, rows], up[:, rows]], 1))
        torch.testing.assert_close(layer.down_proj, w2[:, :, rows])
        partials.append(layer(x, weights, ids))
    torch.testing.assert_close(sum(partials), moe_reference(x, w13, w2, weights, ids))


def test_a_wrong_expert_shape_is_a_value_error(full_weights: tuple[torch.Tensor, ...]) -> None:
    with as_rank(2, 1):
        layer = FusedMoE(EXPERTS, HIDDEN, INTER)
    w13, w2 = full_weights
    with pytest.raises(ValueError, match="does not fit expert weight"):
        layer.weight_loader(layer.gate_up_proj, w13[:, :INTER])
    with pytest.raises(ValueError, match="does not fit expert weight"):
        layer.weight_loader(layer.down_proj, w2[0, :, :4], None, 0)
    with pytest.raises(ValueError, match="unknown shard 'down'"):
        layer.weight_loader(layer.gate_up_proj, w13[0, :INTER], "down", 0)


def test_moe_dummy_weights_do_not_depend_on_the_degree(tmp_path: Path) -> None:
    save_tiny_moe(tmp_path, "qwen3-moe-dense-first")
    config = ModelConfig.resolve(str(tmp_path), dtype="float32", load_format="dummy")

    def params(tp: int, rank: int) -> dict[str, torch.Tensor]:
        with as_rank(tp, rank):
            model = build_model(config, "cpu")
            init_dummy_weights(model)
        return dict(model.named_parameters())

    full, ranks = params(1, 0), [params(2, rank) for rank in range(2)]
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    gate, up = full[gate_up].chunk(2, dim=1)
    for rank, shard in enumerate(ranks):
        halves = [part.chunk(2, dim=1)[rank] for part in (gate, up)]
        torch.testing.assert_close(shard[gate_up], torch.cat(halves, 1))
    down = "model.layers.2.mlp.experts.down_proj"
    torch.testing.assert_close(torch.cat([p[down] for p in ranks], 2), full[down])
    router = "model.layers.1.mlp.gate.weight"
    assert all(torch.equal(p[router], full[router]) for p in ranks)


@pytest.mark.parametrize("case", ["qwen3-moe-dense-first", "mixtral"])
def test_tp2_moe_matches_hf(case: str, tmp_path: Path) -> None:
    save_tiny_moe(tmp_path, case)
    prompts = random_prompts(190, (5, 17, 9))
    expected = [hf_greedy(tmp_path, p, 12) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tp1 = token_ids(prompts, params, model=str(tmp_path))
    tp2 = token_ids(prompts, params, model=str(tmp_path), tensor_parallel_size=2)
    assert [t for t, _, _ in tp2] == [t for t, _, _ in tp1] == expected
