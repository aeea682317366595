"""The benchmarks' random adapters: in PEFT's layout for the model (read back by the engine's
own checks), and a workload's requests spread over them in turn."""

from __future__ import annotations

import argparse
import subprocess
import sys
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


def test_random_adapters_are_removed_when_the_process_exits(tiny_llama_dir: Path) -> None:
    script = (
        "import argparse, sys\n"
        "from attnserve.bench.lora import random_lora_requests\n"
        "from attnserve.model import ModelConfig\n"
        "config = ModelConfig.resolve(sys.argv[1])\n"
        "requests = random_lora_requests(argparse.Namespace(num_loras=1, lora_rank=2), config)\n"
        "print(requests[0].lora_path)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_llama_dir)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert folder.name == "lora0" and folder.parent.name.startswith("attnserve-bench-lora-")
    assert not folder.parent.exists()
