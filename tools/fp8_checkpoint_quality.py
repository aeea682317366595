"""How far FP8 checkpoints, loaded as stored, are from the float checkpoint they were quantized
from (issue 30): block-wise HF (`weight_block_size`), block-wise compressed-tensors, and
per-channel compressed-tensors.

    PYTHONPATH=src:. python3 tools/fp8_checkpoint_quality.py PRESET [--device cuda]
        [--block 128,128] [--json FILE]

A random model of the preset's shape (its matrices drawn from N(0, 0.02)) is saved as a float
checkpoint, then each FP8 layout is written from it by the tests' writers, which implement the
published quantization math (tests/model/test_fp8.py, tests/model/test_fp8_block.py). Each FP8
checkpoint runs the measurement of `attnserve bench kv-quality` against the float one on the
same prompts: 8 random prompts of 256 tokens, then 32 decode steps teacher-forced with the float
run's greedy tokens; printed: the relative error of the final hidden states and of the logits,
and the share of positions whose top-1 token agrees. The float run computes in bfloat16 on CUDA
and in float32 on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from attnserve.bench import kv_quality
from attnserve.engine.arg_utils import EngineArgs
from attnserve.model.presets import preset_hf_config
from tests.model import test_fp8, test_fp8_block

NUM_PROMPTS, PROMPT_LEN, DECODE_STEPS = 8, 256, 32
Quantize = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _save_random_model(preset: str, target: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_hf_config(preset), dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.02)
    model.save_pretrained(target, max_shard_size="100GB")


def _layouts(block: tuple[int, int]) -> dict[str, tuple[dict[str, Any], Quantize]]:
    """Each layout's quantization_config and what it writes for one weight."""
    group = test_fp8.CHANNEL["config_groups"]["group_0"]
    block_group = {
        **group,
        "weights": {**group["weights"], "strategy": "block", "block_structure": list(block)},
        "input_activations": {
            **group["input_activations"], "strategy": "group", "group_size": block[1],
        },
    }  # fmt: skip

    def blocks(scale_suffix: str) -> Quantize:
        def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
            quantized, scales = test_fp8_block.quantize_blocks(weight.float(), block)
            return {"": quantized, scale_suffix: scales}

        return quantize

    hf_block = {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}  # fmt: skip
    ct_block = {**test_fp8.CHANNEL, "config_groups": {"group_0": block_group}}
    return {
        "hf_block": (hf_block, blocks("_scale_inv")),
        "compressed_tensors_block": (ct_block, blocks("_scale")),
        "compressed_tensors_channel": (test_fp8.CHANNEL, test_fp8._per_channel),
    }


def measure(preset: str, device: str, block: tuple[int, int], work: Path) -> dict[str, Any]:
    float_dir = work / "float"
    _save_random_model(preset, float_dir)
    dtype = "bfloat16" if device == "cuda" else "float32"
    base = EngineArgs(model=str(float_dir), device=device, dtype=dtype,
                      kv_cache_memory_bytes=kv_quality.DEFAULT_CACHE_BYTES)  # fmt: skip
    reference = kv_quality.reference_run(base, NUM_PROMPTS, PROMPT_LEN, DECODE_STEPS, seed=0)
    results = {}
    for name, (config, quantize) in _layouts(block).items():
        target = work / name
        test_fp8.write_quantized_checkpoint(float_dir, target, config, quantize)
        _, results[name] = kv_quality.measured_run(
            dataclasses.replace(base, model=str(target)), reference
        )
        print(name, json.dumps(results[name]), flush=True)
    return {"preset": preset, "device": device, "float_dtype": dtype, "block": list(block),
            "results": results}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--block", default="128,128", help="rows,columns of a weight block")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, columns = (int(v) for v in args.block.split(","))
    with tempfile.TemporaryDirectory() as work:
        result = measure(args.preset, args.device, (rows, columns), Path(work))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
