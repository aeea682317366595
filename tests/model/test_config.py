"""ModelConfig.resolve's validation, dummy presets against HF's own model shapes and the
published parameter counts, and dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from attnserve.model import ModelConfig
from attnserve.model.loader import build_model
from attnserve.model.presets import preset_hf_config
from tests.model.paged import PagedRunner, load_reference_model

# Parameter counts of the released checkpoints (tied embeddings counted once).
KNOWN_SIZES = {
    "qwen3-0.6b": 596_049_920,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "qwen3-30b-a3b": 30_532_122_624,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("preset", list(KNOWN_SIZES))
def test_dummy_preset_shapes(preset: str) -> None:
    config = ModelConfig.resolve(preset)
    ours = build_model(config, "meta")
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(preset_hf_config(preset))
    ours_shapes = {name: p.shape for name, p in ours.named_parameters()}
    hf_params = dict(hf_model.named_parameters())
    merged = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
    for name, shape in ours_shapes.items():
        parts = next(((m, p) for m, p in merged.items() if f".{m}." in name), None)
        if parts is None:
            assert hf_params[name].shape == shape, name
            continue
        rows = sum(hf_params[name.replace(parts[0], p)].shape[0] for p in parts[1])
        assert (
            shape[0] == rows
            and shape[1:] == hf_params[name.replace(parts[0], parts[1][0])].shape[1:]
        )
    assert sum(p.numel() for p in ours.parameters()) == KNOWN_SIZES[preset]
    assert sum(p.numel() for p in hf_model.parameters()) == KNOWN_SIZES[preset]


def test_dummy_weights_are_seeded_and_usable() -> None:
    config = ModelConfig.resolve("llama-tiny", max_model_len=64)
    assert config.tokenizer is None and config.load_format == "dummy"
    logits = []
    for _ in range(2):
        model = load_reference_model(config)
        logits.append(PagedRunner(model, config, max_len=8, seqs=1).run([[5, 6, 7, 8]], [[9]])[0])
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    assert torch.isfinite(logits[0]).all()
    assert logits[0].std() > 1e-3
    assert len(set(logits[0].argmax(-1).tolist())) > 1


def test_dtype_resolution() -> None:
    assert ModelConfig.resolve("llama-tiny").dtype == torch.float32
    assert ModelConfig.resolve("llama-tiny", dtype="bfloat16").dtype == torch.bfloat16
    assert ModelConfig.resolve("llama-tiny", dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="float64"):
        ModelConfig.resolve("llama-tiny", dtype="float64")


def test_unknown_preset_or_missing_path() -> None:
    with pytest.raises(ValueError, match="no-such-model"):
        ModelConfig.resolve("no-such-model")
    with pytest.raises(ValueError, match=r"/nonexistent/model\.gguf"):
        ModelConfig.resolve("/nonexistent/model.gguf")


def _hf_dir(tmp_path: Path, **config: object) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.resolve(path)


def test_directory_problems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelConfig.resolve(str(tmp_path))
    path = _hf_dir(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="safetensors"):
        ModelConfig.resolve(path)
    assert ModelConfig.resolve(path, load_format="dummy").load_format == "dummy"


def test_max_model_len_and_rope_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len 4096"):
        ModelConfig.resolve("llama-tiny", max_model_len=4096)
    assert ModelConfig.resolve("llama-tiny", max_model_len=100).max_model_len == 100
    path = _hf_dir(
        tmp_path,
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.resolve(path, load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig.resolve("llama-tiny", load_format="pt")
