"""Gemma 2 against HF transformers on the same tiny random weights, in float32 on the CPU:
greedy tokens through `LLM` for prompts longer than the sliding window, with and without prefix
caching and with chunked prefill; and the dummy preset at its real config (config and a meta
build only, no weights)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from attnserve import LLM, SamplingParams
from attnserve.attention import Attention
from attnserve.model import ModelConfig
from attnserve.model.config import layer_sliding_windows
from attnserve.model.loader import build_model
from tests.conftest import hf_greedy

WINDOW = 8
TINY_GEMMA2: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,
    "attn_logit_softcapping": 4.0,
    "final_logit_softcapping": 5.0,
}
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_SETUPS: dict[str, dict[str, Any]] = {
    "prefix-cache": {"block_size": 4},
    "no-prefix-cache": {"block_size": 4, "enable_prefix_caching": False},
    "chunked-prefill": {"block_size": 4, "max_num_batched_tokens": 6},
}


def save_random_hf(path: Path, config: Any) -> Path:
    """An HF causal LM of `config` with random weights, saved as safetensors in `path`: std 0.2,
    the (tied, sqrt(hidden)-scaled) embeddings' 0.05 so that they do not drown the layers (the
    greedy tokens would repeat the last one)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.05 if "embed_tokens" in name else 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.Gemma2Config(**TINY_GEMMA2)
    config.architectures = ["Gemma2ForCausalLM"]
    return save_random_hf(tmp_path_factory.mktemp("gemma2"), config)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts shorter than, a little longer than and several times the window."""
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 13, 29)]


@pytest.fixture(scope="module")
def expected(gemma2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(gemma2_dir, prompt, NEW_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("setup", ENGINE_SETUPS)
def test_gemma2_greedy_matches_hf(
    gemma2_dir: Path, prompts: list[list[int]], expected: list[list[int]], setup: str
) -> None:
    llm = LLM(str(gemma2_dir), device="cpu", dtype="float32", **ENGINE_SETUPS[setup])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    if setup == "prefix-cache":  # again, from the cached prefixes
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == expected
        assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0.3


def test_gemma2_tokens_are_not_trivial(expected: list[list[int]]) -> None:
    """Random weights that give one token over and over would check little."""
    assert len({token for tokens in expected for token in tokens}) > NEW_TOKENS


def test_gemma2_preset_is_the_real_config() -> None:
    config = ModelConfig.resolve("gemma-2-9b", load_format="dummy")
    assert config.architecture == "Gemma2ForCausalLM"
    assert (config.num_layers, config.hidden_size, config.head_size) == (42, 3584, 256)
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (16, 8, 256000)
    assert layer_sliding_windows(config.hf_config) == [4096, None] * 21
    assert config.max_model_len == 8192
    model = build_model(config, "meta")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [layer.spec.sliding_window for layer in layers] == [4096, None] * 21
    assert {layer.spec.logits_soft_cap for layer in layers} == {50.0}
    assert {layer.scale for layer in layers} == {256**-0.5}
    assert model.lm_head is model.model.embed_tokens
    assert model.model.embed_scale == float(torch.tensor(3584**0.5).to(config.dtype))
