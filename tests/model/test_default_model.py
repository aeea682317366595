"""The embedded SmolLM2-135M-Instruct GGUF: conversion into the cache (keyed by content, one
writer at a time under the cache's lock), the tokenizer, and a greedy answer that only a
correctly dequantized and un-permuted model gets right. (Loading the GGUF through transformers
takes over 30 s here, so the GGUF path's logits are checked against transformers on a tiny
llama.cpp-style file in test_gguf.py, and here by the greedy answer.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnserve.model import ModelConfig, load_tokenizer
from attnserve.model import default_model as default_model_module
from attnserve.model.default_model import converted_dir, default_model_dir, embedded_gguf_path
from attnserve.model.model_cache import (
    LOCK_NAME,
    STAGING_PREFIX,
    clear_cache,
    locked,
    staging_dir,
)
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
    path = default_model_dir(cache_dir)
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [LOCK_NAME, Path(path).name]


def test_cache_key_follows_the_content_not_the_install(tmp_path: Path) -> None:
    first, second = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    content = bytes(range(256)) * 10_000  # over 2 MiB: both ends are hashed
    for gguf in (first, second):
        gguf.parent.mkdir()
        gguf.write_bytes(content)
    os.utime(second, ns=(0, 10**9))
    key = converted_dir(first, tmp_path)
    assert converted_dir(second, tmp_path) == key  # another install, another mtime: one copy
    second.write_bytes(content[:-1] + b"x")  # same size, a changed last byte
    assert converted_dir(second, tmp_path) != key
    assert key.parent == tmp_path and key.name.startswith(f"m-{len(content)}-")


WRITER = """
import sys
from pathlib import Path
from attnserve.model import default_model
def convert(gguf, target):
    raise SystemExit("converted although the lock's holder had written it")
default_model.convert_gguf_to_cache_dir = convert
print(default_model.default_model_dir(sys.argv[1]))
"""


def test_a_writer_waits_for_the_lock_and_then_finds_the_conversion(tmp_path: Path) -> None:
    target = converted_dir(embedded_gguf_path(), tmp_path)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(["src", *sys.path])}
    with locked(tmp_path):  # this process is converting: the other must wait, then reuse it
        other = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        target.mkdir()
        (target / "config.json").write_text("{}")
    out, err = other.communicate()
    assert other.returncode == 0, err
    assert out.strip() == str(target)


def test_a_killed_writers_staging_directory_is_removed_by_the_next(tmp_path: Path) -> None:
    stale = tmp_path / f"{STAGING_PREFIX}model-123"
    stale.mkdir(parents=True)
    with locked(tmp_path):
        fresh = staging_dir(tmp_path, "model")
    assert not stale.exists() and fresh.is_dir() and fresh.name.startswith(STAGING_PREFIX)


def test_clear_refuses_while_a_conversion_runs(tmp_path: Path) -> None:
    (tmp_path / "entry").mkdir()
    with locked(tmp_path), pytest.raises(ValueError, match="converting a model into"):
        clear_cache(tmp_path)  # flock: another open of the lock file conflicts, as in a process
    assert [e.path.name for e in clear_cache(tmp_path)] == ["entry"]


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
