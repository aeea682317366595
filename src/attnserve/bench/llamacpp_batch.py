"""llama.cpp on a whole workload at once, for `attnserve bench throughput` on the CPU: the same
GGUF file, the same prompts (token ids) and output lengths, the same thread count, every
sequence in one batch.

The run is llama-cpp-python's low-level API in a subprocess of an interpreter that has it
(`LLAMA_CPP_BATCH`, reading its job as JSON on stdin): one context with a sequence id per
request (`n_seq_max` = requests), a `llama_batch` holding every prompt's tokens (each with its
sequence id; logits for each prompt's last token only) decoded by one `llama_decode`, then one
batch a step with the next token of every sequence still running, greedy (argmax of its logits,
the end-of-sequence token included: no sequence stops early), until each has its output length.
Timed: from the prompts' batch to the last step, after a warm-up on a context of its own; the
context is made and freed outside the timing. Prints {"seconds", "tokens", "outputs"}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from attnserve.bench.common import Workload, progress
from attnserve.model.default_model import embedded_gguf_path

LLAMA_CPP_BATCH = """
import json, sys, time
import numpy as np
import llama_cpp as L

job = json.load(sys.stdin)
L.llama_backend_init()
load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
model = load(job["path"].encode(), L.llama_model_default_params())
if hasattr(L, "llama_model_get_vocab"):
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
else:
    n_vocab = L.llama_n_vocab(model)


def context(prompts, outputs):
    params = L.llama_context_default_params()
    n = len(prompts)
    longest = max(len(p) + o for p, o in zip(prompts, outputs))
    params.n_ctx = n * (longest + 16)  # room for every sequence, even where split per sequence
    params.n_batch = max(sum(map(len, prompts)), n)
    params.n_ubatch = min(512, params.n_batch)
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = job["threads"]
    new = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
    return new(model, params), L.llama_batch_init(params.n_batch, 0, 1)


def decode(ctx, batch, entries):
    # entries: (token, position, sequence id, wants logits); returns the argmax of each
    # wanted row, in order
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, wanted) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, wanted
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    rows = sum(1 for entry in entries if entry[3])
    logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, n_vocab))
    return logits.argmax(axis=1).tolist()


def run(prompts, outputs):
    ctx, batch = context(prompts, outputs)
    started = time.perf_counter()
    last = decode(ctx, batch, [(t, i, s, i == len(p) - 1)
                               for s, p in enumerate(prompts) for i, t in enumerate(p)])
    made = [[t] for t in last]
    live = [s for s in range(len(prompts)) if outputs[s] > 1]
    while live:
        steps = [(made[s][-1], len(prompts[s]) + len(made[s]) - 1, s, True) for s in live]
        for s, token in zip(live, decode(ctx, batch, steps)):
            made[s].append(token)
        live = [s for s in live if len(made[s]) < outputs[s]]
    seconds = time.perf_counter() - started
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return seconds, made


run(job["prompts"][:2], [4] * min(2, len(job["prompts"])))
seconds, made = run(job["prompts"], job["output_lens"])
print(json.dumps({"seconds": seconds, "tokens": sum(map(len, made)), "outputs": made}))
"""


def llama_cpp_importable(python: str) -> bool:
    """Whether interpreter `python` can import llama_cpp."""
    probe = [python, "-c", "import llama_cpp"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def run_llama_cpp_batched(
    python: str, gguf: str | Path, workload: Workload, threads: int
) -> dict[str, Any]:
    """The figures of one batched llama.cpp run of `workload` (see the module); RuntimeError
    where it fails."""
    job = {
        "path": str(gguf),
        "threads": threads,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
    }
    done = subprocess.run(
        [python, "-c", LLAMA_CPP_BATCH],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp failed ({done.returncode}): {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def llama_cpp_batched_figures(
    model: str | None, device: torch.device, workload: Workload, tokens_per_s: float
) -> dict[str, float]:
    """llama.cpp's batched output tokens/s on `workload` and attnserve's `tokens_per_s` over
    it, on torch's thread count, where it can run: on the CPU, with a .gguf `model` (None: the
    embedded default model's file) and llama_cpp importable here; else {} (saying why)."""
    if device.type != "cpu":
        return {}
    if model is not None and not str(model).endswith(".gguf"):
        progress("no llama.cpp baseline: the model is not a .gguf file")
        return {}
    if not llama_cpp_importable(sys.executable):
        progress("no llama.cpp baseline: llama_cpp (llama-cpp-python) is not installed")
        return {}
    gguf = model if model is not None else embedded_gguf_path()
    progress(f"timing llama.cpp batched on {len(workload.prompts)} requests")
    figures = run_llama_cpp_batched(sys.executable, gguf, workload, torch.get_num_threads())
    theirs = figures["tokens"] / figures["seconds"]
    return {"llama_cpp_batched_tokens_per_s": theirs, "ratio_to_llama_cpp": tokens_per_s / theirs}
