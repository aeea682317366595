"""The `quantization` option, decided before any weight is read: the checkpoint's own by
default, and a ValueError naming the problem for a value, checkpoint or device that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnserve import LLM
from attnserve.engine.arg_utils import EngineArgs
from attnserve.model import ModelConfig
from attnserve.model.quantization.resolve import resolve_quantization


def test_a_bad_value_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown quantization 'awq'.*\['gguf', 'fp8', 'none'\]"):
        EngineArgs(model="llama-tiny", quantization="awq").create_engine_config()
    with pytest.raises(ValueError, match="unknown quantization 'GGUF'"):
        LLM("llama-tiny", load_format="dummy", device="cpu", quantization="GGUF")


def test_unquantized_checkpoints_run_unquantized_by_default(tiny_llama_dir: Path) -> None:
    assert ModelConfig.resolve(str(tiny_llama_dir)).quantization is None
    assert ModelConfig.resolve("llama-tiny").quantization is None


@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "message"),
    [
        ("gguf", None, "cpu", "'gguf' needs GGUF weights"),
        ("gguf", "gguf", "cuda", "runs on the CPU only"),
        ("fp8", "gguf", "cpu", "'fp8' takes float or FP8 weights"),
        ("none", "fp8", "cpu", "the checkpoint is FP8"),
    ],
)
def test_combinations_that_cannot_run(
    requested: str, checkpoint: str | None, device: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_quantization(requested, checkpoint, device, torch.float32)


def test_gguf_defaults_to_packed_on_the_cpu_and_dequantized_elsewhere() -> None:
    assert resolve_quantization(None, "gguf", "cpu", torch.float32) == "gguf"
    assert resolve_quantization(None, "gguf", "cuda", torch.bfloat16) is None
    assert resolve_quantization("none", "gguf", "cpu", torch.float32) is None


def test_fp8_on_the_cpu_runs_where_torch_has_the_kernel() -> None:
    """torch's CPU `_scaled_mm` (present in the torch versions attnserve supports) runs FP8."""
    assert resolve_quantization("fp8", None, "cpu", torch.float32) == "fp8"


def _with_quantization_config(source: Path, target: Path, config: dict[str, object]) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    settings = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**settings, "quantization_config": config}))
    return target


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quantized with 'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "only 'dynamic'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size \[128, 0\]"),
        (
            {"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp"]},
            "keeps \\['model.layers.0.mlp'\\] unquantized",
        ),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
    ],
)
def test_checkpoint_quantizations_that_cannot_load(
    tiny_llama_dir: Path, tmp_path: Path, config: dict[str, object], message: str
) -> None:
    directory = _with_quantization_config(tiny_llama_dir, tmp_path / "q", config)
    with pytest.raises(ValueError, match=message):
        ModelConfig.resolve(str(directory))
