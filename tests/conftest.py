"""Shared fixtures: a tiny random Llama saved as an HF directory, HF's own greedy output, the
embedded default model's engines (kept packed, and dequantized) loaded once per session,
`wait_until` for what happens in another process, and the `cuda` marker's skip (tests/gpu/).

The suite runs torch with one intra-op thread (and its subprocesses, through OMP_NUM_THREADS):
its models are small, and on a busy machine (two cores, other jobs) OpenMP's threads wait for
each other at every op, which makes a step ten times slower. Results do not depend on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from attnserve import LLM

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Hypothesis without a clock: no per-example deadline, no health check that times generation.
settings.register_profile("no-clock", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-clock")

# Only a hang takes this long: no test waits on a clock, this bound just turns a hang into a
# failure. (The slowest wait here, under a loaded two-core machine, is a few seconds.)
HANG_GUARD_S = 600.0


def wait_until(done: Callable[[], bool], what: str) -> None:
    """Poll `done` until it holds; fail only on a hang (see HANG_GUARD_S)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting for {what} after {HANG_GUARD_S:.0f} s: a hang")
        time.sleep(0.05)


TINY_LLAMA = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "eos_token_id": 383,
    "bos_token_id": 1,
}


def _save_random_llama(factory: pytest.TempPathFactory, name: str, config: dict[str, Any]) -> Path:
    """An HF LlamaForCausalLM of `config` with random weights (std large enough for varied
    argmaxes), saved as safetensors in a fresh directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    path = factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF LlamaForCausalLM with random weights."""
    return _save_random_llama(tmp_path_factory, "tiny_llama", TINY_LLAMA)


HEAD64_LLAMA = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256, "head_dim": 64,
                "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip


@pytest.fixture(scope="session")
def head64_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_llama_dir`'s kind of model with heads of 64 (the TRITON backend's smallest)."""
    return _save_random_llama(tmp_path_factory, "head64_llama", HEAD64_LLAMA)


@pytest.fixture(scope="session")
def default_llm() -> Iterator[LLM]:
    """`LLM()` on the embedded default model as a CPU user gets it (GGUF weights kept packed),
    max_model_len 1024. Tests that share it leave no request or KV block behind."""
    from attnserve import LLM

    llm = LLM(device="cpu", max_model_len=1024)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def default_llm_dequantized() -> Iterator[LLM]:
    """The embedded default model with its GGUF weights dequantized to fp32 (quantization
    "none"), max_model_len 512: the engine compared with HF transformers on the same weights."""
    from attnserve import LLM

    llm = LLM(device="cpu", max_model_len=512, quantization="none")
    yield llm
    llm.shutdown()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' own greedy continuation of `prompt` (no EOS stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run on through EOS, like ignore_eos
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip tests marked `cuda(gpus=N)` (N defaults to 1) where fewer CUDA GPUs are visible."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        needed = int(marker.kwargs.get("gpus", 1))
        if visible < needed:
            reason = f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, {visible} visible"
            item.add_marker(pytest.mark.skip(reason=reason))
