"""Speculative decoding on a CUDA GPU: n-gram drafts, and the target drafting for itself (method
"draft_model": its catch-up passes, one-token draft steps and their graphs), change no greedy
token in fp32 (the verify step's prompt-like query against the plain decode steps), eagerly and
with CUDA graphs (decode steps replay whole graphs, verify steps the piecewise ones), with
batched sequences, for every backend that serves the model there."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve.attention import backend_names
from tests.spec_decode.test_speculative_decoding import (
    GREEDY,
    PROMPTS,
    SPEC,
    assert_same_outputs,
    assert_speculated,
    generate,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", backend_names())
def test_greedy_outputs_equal_without_speculation(
    head64_llama_dir: Path, backend: str, enforce_eager: bool, method: str
) -> None:
    engine = {"device": "cuda", "attention_backend": backend, "enforce_eager": enforce_eager,
              "gpu_memory_utilization": 0.3}  # fmt: skip
    model = str(head64_llama_dir)
    try:
        want, _ = generate(model, PROMPTS, GREEDY, **engine)
    except ValueError as error:  # the backend does not serve this model here
        pytest.skip(str(error))
    spec = SPEC if method == "ngram" else {"model": model, "num_speculative_tokens": 3}
    got, stats = generate(model, PROMPTS, GREEDY, speculative_config=spec, **engine)
    assert_same_outputs(got, want)
    assert_speculated(stats)
