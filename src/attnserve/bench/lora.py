"""Random LoRA adapters for the benchmarks (`--num-loras N --lora-rank R`): N adapters of rank R
on all seven projections of the model, written in PEFT's layout to a temporary folder, and the
workload's requests spread over them in turn (vLLM's benchmark spreads them at random)."""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from attnserve.bench.common import Workload
from attnserve.lora.peft import CONFIG_FILE, WEIGHTS_FILE
from attnserve.lora.request import LoRARequest
from attnserve.lora.targets import MLP_MODULES, LoRATargets
from attnserve.model.config import ModelConfig


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-loras", type=int, default=0,
        help="spread the requests over this many random LoRA adapters (needs --enable-lora "
        "and --max-loras N for N at once)",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank")


def write_random_adapter(folder: Path, targets: LoRATargets, rank: int, seed: int) -> Path:
    """A random adapter of `rank` on every projection of `targets`' model, in PEFT's layout."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(targets.num_layers):
        for module, (fan_in, fan_out) in targets.shapes.items():
            parent = "mlp" if module in MLP_MODULES else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{name}.lora_A.weight"] = a.half()
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) * 0.01
            ).half()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": sorted(targets.shapes)}  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def random_lora_requests(args: argparse.Namespace, model_config: ModelConfig) -> list[LoRARequest]:
    """`--num-loras` random adapters of `--lora-rank` for the model, written to a temporary
    folder removed when the process exits (none without `--num-loras`)."""
    if not args.num_loras:
        return []
    targets = LoRATargets.of_model(model_config)
    root = Path(tempfile.mkdtemp(prefix="attnserve-bench-lora-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return [
        LoRARequest(
            f"lora{i}",
            i + 1,
            str(write_random_adapter(root / f"lora{i}", targets, args.lora_rank, i)),
        )
        for i in range(args.num_loras)
    ]


def with_random_loras(
    workload: Workload, args: argparse.Namespace, model_config: ModelConfig
) -> Workload:
    """`workload` with its requests spread over `--num-loras` random adapters in turn;
    unchanged without."""
    requests = random_lora_requests(args, model_config)
    if not requests:
        return workload
    spread = [requests[i % len(requests)] for i in range(len(workload.prompts))]
    return replace(workload, lora_requests=spread)
