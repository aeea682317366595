"""Qwen3-MoE and Mixtral against HF transformers on the same weights, in float32: tiny random
checkpoints written by `save_pretrained` give HF's greedy tokens through `LLM` and HF's logits
through the paged KV cache; HF's stacked (in-memory) expert names load the same model; our dummy
weights exported with `to_hf_model` give our logits; bad checkpoints and configs are refused."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from attnserve import LLM, SamplingParams
from attnserve.model import ModelConfig
from attnserve.model.config import sparse_layers
from attnserve.model.layers.moe import SparseMoeBlock
from attnserve.model.loader import build_model
from attnserve.model.models.hf_export import to_hf_model
from tests.conftest import hf_greedy
from tests.model.paged import PagedRunner, load_reference_model
from tests.model.tiny_moe import CASES, TINY_MOE, save_tiny_moe

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """case -> (its save_pretrained directory, HF's model)."""
    saved = {}
    for case in CASES:
        path = tmp_path_factory.mktemp(case)
        saved[case] = (path, save_tiny_moe(path, case))
    return saved


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 190) for _ in range(n)] for n in (6, 19, 11)]


def _paged_logits(model: Any, config: ModelConfig, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Our logits at every position: each prompt but its last 3 tokens in one prefill step, then
    those 3 as decode steps."""
    runner = PagedRunner(model, config, max_len=max(len(s) for s in seqs), seqs=len(seqs))
    return runner.run([s[:-3].tolist() for s in seqs], [s[-3:].tolist() for s in seqs])


def _hf_logits(hf_model: Any, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf_model(seq[None]).logits[0] for seq in seqs]


def _random_seqs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY_MOE["vocab_size"], (n,), generator=gen) for n in (9, 14, 6)]


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_layers_are_hfs(checkpoints: dict[str, tuple[Path, Any]], case: str) -> None:
    path, hf_model = checkpoints[case]
    config = ModelConfig.resolve(str(path), dtype="float32")
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in hf_model.model.layers]
    assert sparse_layers(config.hf_config) == hf_sparse
    ours = build_model(config, "meta")
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == hf_sparse
    assert any(hf_sparse)
    assert all(hf_sparse) == (case in ("qwen3-moe-norm-topk", "mixtral"))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf(checkpoints: dict[str, tuple[Path, Any]], case: str) -> None:
    path = checkpoints[case][0]
    prompts = _prompts()
    expected = [hf_greedy(path, prompt, NEW_TOKENS) for prompt in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(checkpoints: dict[str, tuple[Path, Any]], case: str) -> None:
    path, hf_model = checkpoints[case]
    config = ModelConfig.resolve(str(path), dtype="float32")
    seqs = _random_seqs()
    ours = _paged_logits(load_reference_model(config), config, seqs)
    for got, want in zip(ours, _hf_logits(hf_model, seqs), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["qwen3-moe-dense-first", "mixtral"])
def test_stacked_expert_names_load(
    checkpoints: dict[str, tuple[Path, Any]], case: str, tmp_path: Path
) -> None:
    """A checkpoint under HF's in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H])."""
    source, hf_model = checkpoints[case]
    state = hf_model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file({name: t.contiguous() for name, t in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    config = ModelConfig.resolve(str(tmp_path), dtype="float32")
    seqs = _random_seqs()
    ours = _paged_logits(load_reference_model(config), config, seqs)
    for got, want in zip(ours, _hf_logits(hf_model, seqs), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["qwen3-moe-dense-first", "mixtral"])
def test_dummy_weights_export_to_hf(checkpoints: dict[str, tuple[Path, Any]], case: str) -> None:
    config = ModelConfig.resolve(str(checkpoints[case][0]), dtype="float32", load_format="dummy")
    model = load_reference_model(config)
    hf_model = to_hf_model(model, config)
    seqs = _random_seqs()
    for got, want in zip(
        _paged_logits(model, config, seqs), _hf_logits(hf_model, seqs), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _edited_checkpoint(source: Path, target: Path, rename: tuple[str, str]) -> str:
    from safetensors.torch import load_file

    tensors = load_file(source / "model.safetensors")
    old, new = rename
    save_file({n.replace(old, new): t for n, t in tensors.items()}, target / "model.safetensors")
    (target / "config.json").write_text((source / "config.json").read_text())
    return str(target)


@pytest.mark.parametrize(
    ("rename", "error"),
    [
        (("experts.3.w1.", "experts.4.w1."), "expert 4 out of range"),
        (("experts.1.w3.", "experts.1.w4."), r"experts\.1\.w4\.weight.*no parameter"),
        (("experts.0.w2.", "experts.0.down."), "no parameter"),
    ],
)
def test_bad_expert_weights_are_refused(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, rename: tuple[str, str], error: str
) -> None:
    path = _edited_checkpoint(checkpoints["mixtral"][0], tmp_path, rename)
    with pytest.raises(ValueError, match=error):
        load_reference_model(ModelConfig.resolve(path, dtype="float32"))


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok 9 must be in 1\.\.8"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
    ],
)
def test_bad_moe_configs_are_refused(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path, edit: dict[str, int], error: str
) -> None:
    source = checkpoints["qwen3-moe-norm-topk"][0]
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=error):
        ModelConfig.resolve(str(tmp_path), load_format="dummy")


def test_expert_size_must_split_over_ranks(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    config = ModelConfig.resolve(str(checkpoints["qwen3-moe-norm-topk"][0]), load_format="dummy")
    config.verify_with_parallel_config(2)
    with pytest.raises(ValueError, match="moe_intermediate_size 48"):
        config.verify_with_parallel_config(32)
