"""The benchmarks' random adapters: in PEFT's layout for the model (read back by the engine's
own checks), and a workload's requests spread over them in turn."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnserve.bench.common import Workload
from attnserve.bench.lora import with_random_loras
from attnserve.lora.peft import load_adapter
from attnserve.lora.targets import LoRATargets
from attnserve.model import ModelConfig


def test_random_adapters_load_and_take_turns(tiny_llama_dir: Path) -> None:
    config = ModelConfig.resolve(str(tiny_llama_dir))
    workload = Workload([[1, 2]] * 5, [3] * 5)
    args = argparse.Namespace(num_loras=2, lora_rank=4)
    spread = with_random_loras(workload, args, config)
    assert spread.lora_requests is not None
    assert [r.lora_int_id for r in spread.lora_requests] == [1, 2, 1, 2, 1]
    adapter = load_adapter(spread.lora_requests[0], LoRATargets.of_model(config), 4)
    assert adapter.rank == 4 and len(adapter.weights) == 7 * config.num_layers
    assert with_random_loras(workload, argparse.Namespace(num_loras=0), config) is workload
