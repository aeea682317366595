"""The embedded SmolLM2-135M-Instruct GGUF: conversion into the cache, the tokenizer, and a
greedy answer that only a correctly dequantized and un-permuted model gets right. (Loading the
GGUF through transformers takes over 30 s here, so the GGUF path's logits are checked against
transformers on a tiny llama.cpp-style file in test_gguf.py, and here by the greedy answer.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from attnserve.model import ModelConfig, load_tokenizer
from attnserve.model import default_model as default_model_module
from attnserve.model.default_model import converted_dir, default_model_dir
from tests.model.paged import PagedRunner, load_reference_model

# HuggingFaceTB/SmolLM2-135M-Instruct config.json
SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
IM_END = 2
MAX_ANSWER = 10


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("attnserve-cache")
    default_model_dir(root)  # the first (slow) conversion
    return root


@pytest.fixture(scope="module")
def config(cache_dir: Path) -> ModelConfig:
    os.environ["ATTNSERVE_CACHE_DIR"] = str(cache_dir)
    try:
        return ModelConfig.resolve(default_model_dir(), dtype="float32")
    finally:
        del os.environ["ATTNSERVE_CACHE_DIR"]


def test_config_of_the_default_model(config: ModelConfig) -> None:
    for key, value in SMOLLM2.items():
        assert getattr(config.hf_config, key) == value, key
    assert config.architecture == "LlamaForCausalLM"
    assert config.load_format == "safetensors" and config.tokenizer == config.model
    assert IM_END in config.eos_token_ids


def test_cached_load_reuses_the_conversion(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model_module, "convert_gguf_to_cache_dir", fail)
    start = time.perf_counter()
    path = default_model_dir(cache_dir)
    assert time.perf_counter() - start < 1.0
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [Path(path).name]


def test_cache_key_follows_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    first = converted_dir(gguf, tmp_path)
    os.utime(gguf, ns=(0, 10**9))
    assert converted_dir(gguf, tmp_path) != first
    gguf.write_bytes(b"xy")
    assert converted_dir(gguf, tmp_path).parent == tmp_path


def test_tokenizer_round_trip_and_chat_template(config: ModelConfig) -> None:
    tokenizer = load_tokenizer(config)
    text = "Hello world, how are you?"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_greedy_answer(config: ModelConfig) -> None:
    tokenizer = load_tokenizer(config)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt).input_ids
    model = load_reference_model(config)
    runner = PagedRunner(model, config, max_len=len(ids) + MAX_ANSWER, seqs=1)
    logits = runner.step([ids])[0]
    answer: list[int] = []
    while len(answer) < MAX_ANSWER and "Paris" not in tokenizer.decode(answer):
        answer.append(int(logits[-1].argmax()))
        logits = runner.step([answer[-1:]])[0]
    assert "Paris" in tokenizer.decode(answer), tokenizer.decode(answer)
