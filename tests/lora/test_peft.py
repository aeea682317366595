"""Reading PEFT adapters: weights by (layer, module), PEFT's scaling (alpha / r, rsLoRA alpha /
sqrt(r)), and each malformed or unsupported adapter refused with a ValueError naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve import LoRARequest
from attnserve.lora.peft import load_adapter
from attnserve.lora.targets import LoRATargets
from attnserve.model import ModelConfig
from tests.conftest import TINY_LLAMA
from tests.lora.adapters import peft_name, write_peft_adapter


@pytest.fixture(scope="module")
def targets(tiny_llama_dir: Path) -> LoRATargets:
    return LoRATargets.of_model(ModelConfig.resolve(str(tiny_llama_dir)))


def _load(folder: Path, targets: LoRATargets, max_rank: int = 16) -> Any:
    return load_adapter(LoRARequest("sql", 1, str(folder)), targets, max_rank)


def test_weights_and_scaling_as_peft_saves_them(tmp_path: Path, targets: LoRATargets) -> None:
    folder = write_peft_adapter(tmp_path / "a", TINY_LLAMA, rank=4, alpha=8.0)
    adapter = _load(folder, targets)
    assert (adapter.rank, adapter.scaling, adapter.int_id) == (4, 2.0, 1)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    pair = adapter.weights[(1, "gate_proj")]
    assert torch.equal(pair.lora_a, saved[peft_name(1, "gate_proj", "A")])
    assert torch.equal(pair.lora_b, saved[peft_name(1, "gate_proj", "B")])
    assert len(adapter.weights) == 2 * 7
    rs = write_peft_adapter(tmp_path / "rs", TINY_LLAMA, rank=4, alpha=8.0, use_rslora=True)
    assert _load(rs, targets).scaling == pytest.approx(8.0 / math.sqrt(4))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"target_modules": ["q_proj", "lm_head"]}, "'lm_head'"),
        ({"r": 0}, "r must be"),
    ],
)
def test_unsupported_options_are_refused(
    tmp_path: Path, targets: LoRATargets, options: dict[str, Any], message: str
) -> None:
    folder = write_peft_adapter(tmp_path / "a", TINY_LLAMA, rank=4, **options)
    with pytest.raises(ValueError, match=f"'sql'.*{message}"):
        _load(folder, targets)


def test_rank_above_the_limit_is_refused(tmp_path: Path, targets: LoRATargets) -> None:
    folder = write_peft_adapter(tmp_path / "a", TINY_LLAMA, rank=32)
    with pytest.raises(ValueError, match=r"'sql'.*rank 32 is above max_lora_rank \(16\)"):
        _load(folder, targets)


def _rewrite(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({peft_name(0, "k_proj", "B"): torch.zeros(64, 4)}, "layer 0 k_proj has lora_A"),
        ({peft_name(1, "up_proj", "B"): None}, "layer 1 up_proj lacks its lora_B"),
        ({peft_name(2, "q_proj", "A"): torch.zeros(4, 64)}, "'q_proj' of layer 2"),
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "'base_model.model.lm"),
        ({peft_name(0, "out_proj", "A"): torch.zeros(4, 64)}, "no module 'out_proj'"),
    ],
)
def test_malformed_weights_are_refused_naming_the_module(
    tmp_path: Path, targets: LoRATargets, change: dict[str, torch.Tensor | None], message: str
) -> None:
    folder = write_peft_adapter(tmp_path / "a", TINY_LLAMA, rank=4)
    _rewrite(folder, change)
    with pytest.raises(ValueError, match=f"'sql'.*{message}"):
        _load(folder, targets)


def test_missing_files_are_refused(tmp_path: Path, targets: LoRATargets) -> None:
    with pytest.raises(ValueError, match=r"'sql'.*no adapter_config\.json"):
        _load(tmp_path, targets)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    with pytest.raises(ValueError, match=r"'sql'.*no adapter_model\.safetensors"):
        _load(tmp_path, targets)


def test_request_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    assert LoRARequest("a", 3, "/x").adapter_id == 3
