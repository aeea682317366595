"""Adapters as PEFT saves them: `adapter_config.json` and `adapter_model.safetensors`, read and
checked against the model (`LoRATargets`) and the engine's limits.

PEFT names a weight `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (A: [r, in])
and `...lora_B.weight` (B: [out, r]); the output of a projection becomes
y = x W^T + scaling · (x A^T) B^T with scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).
Anything the engine would not compute as PEFT does is refused with a ValueError naming the
adapter (and the module where one is at fault): DoRA, `modules_to_save`, trained biases,
`fan_in_fan_out`, per-module rank or alpha patterns, a rank above `max_lora_rank`, a module or
layer the model lacks, a shape that does not match.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnserve.lora.request import LoRARequest
from attnserve.lora.targets import LORA_MODULES, LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHT_NAME = re.compile(
    r"^base_model\.model\.(?:[\w.]+\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# a multimodal checkpoint's parts the engine does not serve (their weights are skipped)
_UNSERVED_PARTS = (".vision_tower.", ".multi_modal_projector.")
# config options the engine cannot honour, with the value that means "not used"
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
}


@dataclass(frozen=True)
class LoRAWeights:
    """One projection's A [r, in] and B [out, r], float32 on the host."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded, checked adapter: its weights by (layer index, module name)."""

    name: str
    int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], LoRAWeights]

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.weights.values())


def load_adapter(request: LoRARequest, targets: LoRATargets, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter `request` names (ValueError naming what is wrong)."""
    name = request.lora_name
    folder = Path(request.lora_path)
    config = _read_config(name, folder)
    rank = _check_config(name, config, max_lora_rank)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(name, folder, targets, rank)
    return LoRAAdapter(name, request.lora_int_id, rank, scaling, weights)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], max_lora_rank: int) -> int:
    """The adapter's rank, once its options are all ones the engine computes."""
    for option, unused in _UNSUPPORTED.items():
        if config.get(option) not in unused:
            raise ValueError(f"LoRA adapter {name!r}: {option}={config[option]!r} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive int, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: rank {rank} is above max_lora_rank ({max_lora_rank})"
        )
    modules = config.get("target_modules")
    if isinstance(modules, list):
        for module in modules:
            if module not in LORA_MODULES:
                raise ValueError(
                    f"LoRA adapter {name!r}: target module {module!r} is not supported "
                    f"(the model's LoRA modules are {list(LORA_MODULES)})"
                )
    return rank


def _read_weights(
    name: str, folder: Path, targets: LoRATargets, rank: int
) -> dict[tuple[int, str], LoRAWeights]:
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path)).items():
        if any(part in key for part in _UNSERVED_PARTS):
            continue
        layer, module, half = _parse_name(name, key, targets)
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return {
        where: _checked_pair(name, where, pair, targets, rank) for where, pair in halves.items()
    }


def _parse_name(name: str, key: str, targets: LoRATargets) -> tuple[int, str, str]:
    match = _WEIGHT_NAME.match(key)
    if match is None:
        raise ValueError(
            f"LoRA adapter {name!r}: weight {key!r} is not a LoRA weight of a decoder layer's "
            f"projection (supported modules: {list(LORA_MODULES)})"
        )
    layer, module, half = int(match.group(1)), match.group(2), match.group(3)
    if module not in targets.shapes:
        raise ValueError(f"LoRA adapter {name!r}: the model has no module {module!r} ({key})")
    if layer >= targets.num_layers:
        raise ValueError(
            f"LoRA adapter {name!r}: module {module!r} of layer {layer}, but the model has "
            f"{targets.num_layers} layers"
        )
    return layer, module, half


def _checked_pair(
    name: str,
    where: tuple[int, str],
    pair: dict[str, torch.Tensor],
    targets: LoRATargets,
    rank: int,
) -> LoRAWeights:
    layer, module = where
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} lacks its {missing}")
    in_features, out_features = targets.shapes[module]
    lora_a, lora_b = pair["A"], pair["B"]
    if tuple(lora_a.shape) != (rank, in_features) or tuple(lora_b.shape) != (out_features, rank):
        raise ValueError(
            f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(lora_a.shape)} "
            f"and lora_B {tuple(lora_b.shape)}, expected {(rank, in_features)} and "
            f"{(out_features, rank)}"
        )
    return LoRAWeights(lora_a.contiguous(), lora_b.contiguous())
