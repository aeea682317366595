"""Gemma 2 and Gemma 3 (text) on a CUDA GPU: engine greedy tokens against HF transformers on the
same tiny random weights (tests/model/test_gemma.py's configs and checkpoints, with heads of 64
so that every CUDA backend can take them, and a sliding window of WINDOW tokens, which every
prompt but the first outgrows; Gemma 2 with attention and final logit soft-caps).

Every registered attention backend that can serve the model on cuda (the selector says which),
in four engine setups: prefix caching (a second pass of prompts that share long prefixes with
the first's, so their cached blocks are hit), no prefix caching, chunked prefill (steps of
CHUNK tokens), and CUDA graphs (decode graphs and piecewise graphs of prompt steps, both seen
replayed; backends that capture graphs). fp32: every token equals HF's (eager attention). bf16:
test_hf_parity.py's rule (where a prompt parts from HF, HF's own bf16 logits put the two tokens
within a few bf16 rounding steps) with a wider bound than its BF16_MAX_STEPS (partings of 0 to 2
steps on Qwen3-0.6B's shape): these tiny random models' bf16 logits are 2-3% off their fp32
values (HF's own no closer than ours), and on the CPU HF's eager and SDPA attention part from
each other by up to 5 steps, TORCH_SDPA from HF by up to 10 (120 prompts each); a TORCH_SDPA
that drops the window or the soft-cap parted here by 24 to 74 steps.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attnserve import LLM
from attnserve.attention import (
    attention_specs,
    backend_names,
    get_backend_cls,
    get_model_attn_backend,
)
from attnserve.model import ModelConfig
from attnserve.model.loader import build_model
from tests.gpu.reference import (
    NEW_TOKENS,
    Reference,
    _hf_greedy,
    assert_parts_only_at_rounding,
    engine_tokens,
)
from tests.gpu.test_hf_parity import BF16_MAX_STEPS
from tests.model.test_gemma import MODELS, save_random_hf

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
WINDOW = 24  # not a multiple of the 16-token blocks
MAX_MODEL_LEN = 512
GPU_CHANGES = {"head_dim": 64, "sliding_window": WINDOW, "max_position_embeddings": MAX_MODEL_LEN}
PROMPT_LENS = (5, 40, 150, 300)
# the second pass: the longest prompt's first n tokens (cached: whole blocks), then m new ones
REUSED = ((37, 6), (160, 20), (300, 5))
CHUNK = 40
BF16_GEMMA_MAX_STEPS = 4 * BF16_MAX_STEPS  # 12: see the docstring
ENGINE: dict[str, Any] = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 128 << 20,
}
SETUPS: dict[str, dict[str, Any]] = {
    "prefix-cache": {"enforce_eager": True},
    "no-prefix-cache": {"enforce_eager": True, "enable_prefix_caching": False},
    "chunked-prefill": {"enforce_eager": True, "max_num_batched_tokens": CHUNK},
    "cuda-graphs": {"enforce_eager": False, "max_num_batched_tokens": 128},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model -> a save_pretrained directory of its random weights."""
    saved = {}
    for arch, (config_cls, settings) in MODELS.items():
        config = getattr(transformers, config_cls)(**(settings | GPU_CHANGES))
        config.architectures = [arch]
        saved[arch] = tmp_path_factory.mktemp(arch)
        save_random_hf(saved[arch], config)
    return saved


def _prompts(vocab_size: int) -> list[list[int]]:
    """PROMPT_LENS random prompts, then the REUSED ones (the second pass)."""
    rng = random.Random(0)
    first = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    longest = first[-1]
    return first + [
        longest[:n] + [rng.randrange(3, vocab_size) for _ in range(m)] for n, m in REUSED
    ]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> Callable[[str, str], Reference]:
    """`references(model, dtype)`: HF (eager attention) on the checkpoint, and its greedy
    tokens for every prompt, built once."""
    built: dict[tuple[str, str], Reference] = {}

    def get(arch: str, dtype: str) -> Reference:
        if (arch, dtype) not in built:
            hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoints[arch], dtype=getattr(torch, dtype), attn_implementation="eager"
            )
            hf.to(DEVICE).eval()
            hf.generation_config.eos_token_id = None  # run on through EOS, like ignore_eos
            prompts = _prompts(hf.config.vocab_size)
            built[(arch, dtype)] = Reference(hf, prompts, [_hf_greedy(hf, p) for p in prompts])
        return built[(arch, dtype)]

    return get


def _skip_unless_servable(path: Path, backend: str, dtype: str, setup: str) -> None:
    """Select `backend` for the model's attention layers as the model runner does."""
    config = ModelConfig.resolve(str(path), dtype=dtype, device=DEVICE)
    specs = [replace(spec, device=DEVICE) for spec in attention_specs(build_model(config, "meta"))]
    assert {spec.sliding_window for spec in specs} == {WINDOW, None}
    try:
        get_model_attn_backend(specs, backend)
    except ValueError as error:
        pytest.skip(str(error))
    if not SETUPS[setup]["enforce_eager"] and not get_backend_cls(backend).capabilities.graphs:
        pytest.skip(f"{backend} captures no CUDA graphs: it runs eagerly either way")


def _count_replays(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many steps run from decode graphs and from piecewise graphs, counted as they run."""
    runner = llm.llm_engine.executor.driver_runner
    counts = {"decode": 0, "prompt": 0}
    for kind, graphs in (("decode", runner.graphs), ("prompt", runner.piecewise_graphs)):
        assert graphs is not None, f"enforce_eager=False captured no {kind} graphs"
        run = graphs.run

        def counted(*args: Any, _kind: str = kind, _run: Any = run, **kwargs: Any) -> Any:
            counts[_kind] += 1
            return _run(*args, **kwargs)

        monkeypatch.setattr(graphs, "run", counted)
    return counts


def _assert_tokens_match(reference: Reference, ours: list[list[int]], dtype: str) -> None:
    """fp32: HF's tokens exactly; bf16: partings only where HF's logits are within rounding."""
    assert [len(tokens) for tokens in ours] == [NEW_TOKENS] * len(reference.prompts)
    if dtype == "float32":
        assert ours == reference.tokens
        return
    partings = assert_parts_only_at_rounding(reference, ours, BF16_GEMMA_MAX_STEPS)
    print(f"bf16 vs HF: {'; '.join(partings) or 'no parting'}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("arch", MODELS)
def test_greedy_tokens_match_hf(
    arch: str,
    backend: str,
    setup: str,
    dtype: str,
    checkpoints: dict[str, Path],
    references: Callable[[str, str], Reference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _skip_unless_servable(checkpoints[arch], backend, dtype, setup)
    reference = references(arch, dtype)
    settings = ENGINE | SETUPS[setup]
    llm = LLM(
        str(checkpoints[arch]), dtype=dtype, device=DEVICE, attention_backend=backend, **settings
    )
    try:
        counts = None if settings["enforce_eager"] else _count_replays(llm, monkeypatch)
        first = engine_tokens(llm, reference.prompts[: len(PROMPT_LENS)])
        hit_rate_before = llm.llm_engine.stats()["prefix_cache_hit_rate"]
        second = engine_tokens(llm, reference.prompts[len(PROMPT_LENS) :])
        hit_rate = llm.llm_engine.stats()["prefix_cache_hit_rate"]
    finally:
        llm.shutdown()
    if settings.get("enable_prefix_caching", True):
        assert hit_rate > hit_rate_before, "the second pass hit no cached block"
    else:
        assert hit_rate == 0
    if counts is not None:  # every decode step of each pass, and prompt steps too
        assert counts["decode"] >= 2 * (NEW_TOKENS - 1) and counts["prompt"] >= 2, counts
    _assert_tokens_match(reference, first + second, dtype)


@pytest.mark.parametrize("arch", MODELS)
def test_hf_tokens_are_not_trivial(arch: str, references: Callable[[str, str], Reference]) -> None:
    """Random weights that give one token over and over would check little."""
    tokens = references(arch, "float32").tokens
    assert len({token for row in tokens for token in row}) > NEW_TOKENS
