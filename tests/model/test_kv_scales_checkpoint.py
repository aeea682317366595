"""fp8 KV-cache scales from the checkpoint (`self_attn.k_scale` / `v_scale`, per tensor or per KV
head): loaded into each layer's `KVCacheScales` for this rank's heads and used instead of
calibrating; a model whose checkpoint has the calibrated run's scales scores exactly as that run
did; unused, and harmless, with an auto cache; refused by name when only some layers have them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

from safetensors.torch import load_file, save_file

from attnserve import LLM
from attnserve.attention import KVCacheScales, attention_layers
from attnserve.model.quantization.fp8_checkpoint import fp8_checkpoint_scheme
from attnserve.worker import model_runner
from tests.model.test_fp8 import CHANNEL
from tests.worker.test_kv_calibration import ENGINE, _prompt_logprobs


def test_a_scale_per_tensor_or_per_head_fills_this_ranks_heads() -> None:
    scales = KVCacheScales(num_kv_heads=2, device="cpu")
    scales.load(0, torch.tensor(0.5), first_head=2)
    assert not scales.from_checkpoint and scales.partly_from_checkpoint
    scales.load(1, torch.tensor([0.1, 0.2, 0.3, 0.4]), first_head=2)  # heads 2 and 3 are ours
    assert scales.from_checkpoint
    assert scales.k_scale.tolist() == [0.5, 0.5]
    torch.testing.assert_close(scales.v_scale, torch.tensor([0.3, 0.4]))


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (torch.tensor([0.1, 0.2, 0.3]), "one per tensor or one per KV head"),
        (torch.tensor(0.0), "positive and finite"),
        (torch.tensor([1.0, 1.0, float("nan"), 1.0]), "positive and finite"),  # in our heads
    ],
)
def test_bad_scales_are_refused(scale: torch.Tensor, message: str) -> None:
    scales = KVCacheScales(num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match=message):
        scales.load(0, scale, first_head=2)
    assert not scales.partly_from_checkpoint


def _with_scales(source: Path, target: Path, scales: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, **scales}, str(target / "model.safetensors"))
    return target


PROMPTS = [[(7 * i + n) % 384 for i in range(n)] for n in (40, 17, 90)]


def test_checkpoint_scales_replace_calibration(
    head64_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calibrated = LLM(str(head64_llama_dir), kv_cache_dtype="fp8", **ENGINE)
    layers = attention_layers(calibrated.llm_engine.executor.driver_runner.model)
    scales = [layer.kv_scales.scales.clone() for layer in layers if layer.kv_scales]
    expected = _prompt_logprobs(calibrated, PROMPTS)
    calibrated.shutdown()
    written = {}
    for i, layer_scales in enumerate(scales):  # keys per tensor, values per KV head
        written[f"model.layers.{i}.self_attn.k_scale"] = layer_scales[0, 0].clone()
        written[f"model.layers.{i}.self_attn.v_scale"] = layer_scales[1].clone()
    checkpoint = _with_scales(head64_llama_dir, tmp_path / "scaled", written)

    def no_calibration(*args: object) -> None:
        raise AssertionError("the checkpoint's scales must be used, not calibrated")

    monkeypatch.setattr(model_runner, "calibration_plan", no_calibration)
    loaded = LLM(str(checkpoint), kv_cache_dtype="fp8", **ENGINE)
    got = attention_layers(loaded.llm_engine.executor.driver_runner.model)
    assert all(torch.equal(layer.kv_scales.scales, s) for layer, s in zip(got, scales, strict=True))
    assert _prompt_logprobs(loaded, PROMPTS) == expected
    loaded.shutdown()

    auto = LLM(str(checkpoint), **ENGINE)  # an auto cache: the scales are read and unused
    unscaled = LLM(str(head64_llama_dir), **ENGINE)
    assert _prompt_logprobs(auto, PROMPTS) == _prompt_logprobs(unscaled, PROMPTS)
    auto.shutdown()
    unscaled.shutdown()


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["model.layers.0.self_attn.k_scale"], "for attention layer 0 but not for all"),
        (["model.layers.9.self_attn.v_scale"], "'model.layers.9.self_attn': no such attention"),
    ],
)
def test_scales_for_some_layers_only_are_refused(
    head64_llama_dir: Path, tmp_path: Path, names: list[str], message: str
) -> None:
    checkpoint = _with_scales(
        head64_llama_dir, tmp_path / "some", dict.fromkeys(names, torch.tensor(0.1))
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoint), kv_cache_dtype="fp8", **ENGINE)


@pytest.mark.parametrize(
    ("scheme", "accepted"),
    [
        ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}, True),
        ({"type": "float", "num_bits": 8, "strategy": "attn_head", "dynamic": False}, True),
        ({"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True}, False),
        ({"type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False}, False),
    ],
)
def test_a_compressed_tensors_kv_cache_scheme_is_checked(
    scheme: dict[str, object], accepted: bool
) -> None:
    config = type("Config", (), {"quantization_config": {**CHANNEL, "kv_cache_scheme": scheme}})
    if accepted:
        assert fp8_checkpoint_scheme(config) is not None
        return
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        fp8_checkpoint_scheme(config)
