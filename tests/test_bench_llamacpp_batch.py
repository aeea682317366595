"""The batched llama.cpp baseline of `bench throughput` (bench/llamacpp_batch.py), run against a
stand-in `llama_cpp` module written here: a "model" whose next token is a fixed function of the
last token and its position, which checks that every sequence's positions follow on. The
tokens the baseline reports must be that function's greedy continuation of each prompt."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from attnserve.bench.common import Workload
from attnserve.bench.llamacpp_batch import llama_cpp_batched_figures, run_llama_cpp_batched

VOCAB = 50

FAKE_LLAMA_CPP = f"""
import ctypes
from types import SimpleNamespace

VOCAB = {VOCAB}


def next_token(token, pos):
    return (7 * token + pos) % VOCAB


def llama_backend_init(): pass
def llama_model_default_params(): return SimpleNamespace()
def llama_model_load_from_file(path, params): return SimpleNamespace(path=path)
def llama_model_get_vocab(model): return model
def llama_vocab_n_tokens(vocab): return VOCAB
def llama_context_default_params(): return SimpleNamespace()
def llama_batch_free(batch): pass
def llama_free(ctx): pass


def llama_init_from_model(model, params):
    return SimpleNamespace(params=params, seen={{}}, logits=None)


def llama_batch_init(n_tokens, embd, n_seq_max):
    return SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens,
                           n_seq_id=[0] * n_tokens, seq_id=[[0] for _ in range(n_tokens)],
                           logits=[False] * n_tokens)


def llama_decode(ctx, batch):
    if batch.n_tokens > ctx.params.n_batch:
        return 1
    rows = []
    for i in range(batch.n_tokens):
        seq = batch.seq_id[i][0]
        if seq >= ctx.params.n_seq_max or batch.pos[i] != ctx.seen.get(seq, 0):
            return 1
        ctx.seen[seq] = batch.pos[i] + 1
        if batch.logits[i]:
            rows.append(next_token(batch.token[i], batch.pos[i]))
    ctx.logits = (ctypes.c_float * (len(rows) * VOCAB))()
    for r, token in enumerate(rows):
        ctx.logits[r * VOCAB + token] = 1.0
    return 0


def llama_get_logits(ctx):
    return ctypes.cast(ctx.logits, ctypes.POINTER(ctypes.c_float))
"""


def _greedy(prompt: list[int], count: int) -> list[int]:
    tokens, pos = [prompt[-1]], len(prompt) - 1
    for _ in range(count):
        tokens.append((7 * tokens[-1] + pos) % VOCAB)
        pos += 1
    return tokens[1:]


def test_every_sequence_decodes_in_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5, 3], [5]]
    workload = Workload(prompts, [4, 1, 6, 3])
    figures = run_llama_cpp_batched(sys.executable, tmp_path / "m.gguf", workload, 2)
    assert figures["outputs"] == [_greedy(p, n) for p, n in zip(prompts, [4, 1, 6, 3], strict=True)]
    assert figures["tokens"] == workload.output_tokens and figures["seconds"] > 0


def test_no_baseline_off_the_cpu_or_without_a_gguf_file() -> None:
    workload = Workload([[1, 2]], [2])
    assert llama_cpp_batched_figures(None, torch.device("meta"), workload, 1.0) == {}
    assert llama_cpp_batched_figures("org/model", torch.device("cpu"), workload, 1.0) == {}
