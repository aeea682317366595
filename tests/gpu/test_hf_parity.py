"""Engine greedy tokens against HF transformers on the same dummy weights, on a CUDA GPU, for
every registered attention backend that can serve the model there.

fp32: every token equals HF's, with the engine run eagerly, and again with its decode steps
replayed from captured CUDA graphs (backends that capture them). bf16, eager and from graphs (the
graph check of backends that serve no fp32): kernels sum in another order than HF, so greedy
tokens may part at near-ties of the random weights' flat distributions; where a prompt parts,
HF's own bf16 logits must put its token and ours within BF16_MAX_STEPS rounding steps of bf16 at
that logit's size (the partings seen on an H200 were 0 to 2 steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

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
    ENGINE,
    MODEL,
    NEW_TOKENS,
    Reference,
    assert_parts_only_at_rounding,
    engine_tokens,
)

pytestmark = pytest.mark.cuda

BF16_MAX_STEPS = 3


def _skip_unless_servable(backend: str, dtype: str) -> None:
    """Select `backend` for the model's attention layers as the model runner does."""
    config = ModelConfig.resolve(MODEL, dtype=dtype, load_format="dummy", device="cuda")
    specs = [replace(spec, device="cuda") for spec in attention_specs(build_model(config, "meta"))]
    try:
        get_model_attn_backend(specs, backend)
    except ValueError as error:
        pytest.skip(str(error))


def _skip_unless_graphed(backend: str, dtype: str) -> None:
    """Skip unless `backend` serves the model here and captures CUDA graphs."""
    _skip_unless_servable(backend, dtype)
    if not get_backend_cls(backend).capabilities.graphs:
        pytest.skip(f"{backend} captures no CUDA graphs: it runs eagerly either way")


def _engine(backend: str, dtype: str, enforce_eager: bool) -> LLM:
    """A fresh engine on `backend`; the test is skipped when the backend cannot serve it here."""
    _skip_unless_servable(backend, dtype)
    return LLM(MODEL, dtype=dtype, attention_backend=backend, enforce_eager=enforce_eager, **ENGINE)


def _tokens(
    backend: str, dtype: str, enforce_eager: bool, prompts: list[list[int]]
) -> list[list[int]]:
    llm = _engine(backend, dtype, enforce_eager)
    try:
        return engine_tokens(llm, prompts)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def fp32_eager_tokens(hf_reference: Callable[[str], Reference]) -> Callable[[str], list[list[int]]]:
    """`fp32_eager_tokens(backend)`: the backend's eager fp32 tokens for the prompts, run once."""
    runs: dict[str, list[list[int]]] = {}

    def get(backend: str) -> list[list[int]]:
        if backend not in runs:
            runs[backend] = _tokens(backend, "float32", True, hf_reference("float32").prompts)
        return runs[backend]

    return get


@pytest.mark.parametrize("backend", backend_names())
def test_fp32_eager_tokens_equal_hf(
    backend: str,
    hf_reference: Callable[[str], Reference],
    fp32_eager_tokens: Callable[[str], list[list[int]]],
) -> None:
    assert fp32_eager_tokens(backend) == hf_reference("float32").tokens


def _graphed_tokens(
    backend: str, dtype: str, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> list[list[int]]:
    """A fresh engine's tokens on `backend` with CUDA graphs, every decode step of the batch
    checked to come from a graph; skipped for a backend that captures none."""
    _skip_unless_graphed(backend, dtype)
    llm = _engine(backend, dtype, enforce_eager=False)
    graphs = llm.llm_engine.executor.driver_runner.graphs
    assert graphs is not None, "enforce_eager=False captured no CUDA graphs"
    replays, replay = [0], graphs.run

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        replays[0] += 1
        return replay(*args, **kwargs)

    monkeypatch.setattr(graphs, "run", counted)
    try:
        tokens = engine_tokens(llm, prompts)
    finally:
        llm.shutdown()
    # one prefill step for every prompt, then every decode step of the batch from a graph
    assert replays[0] >= NEW_TOKENS - 1
    return tokens


@pytest.mark.parametrize("backend", backend_names())
def test_fp32_cuda_graph_replays_give_the_eager_tokens(
    backend: str,
    hf_reference: Callable[[str], Reference],
    fp32_eager_tokens: Callable[[str], list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reference = hf_reference("float32")
    graphed = _graphed_tokens(backend, "float32", reference.prompts, monkeypatch)
    assert graphed == fp32_eager_tokens(backend)
    assert graphed == reference.tokens


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", backend_names())
def test_bf16_tokens_part_from_hf_only_at_rounding_ties(
    backend: str,
    graphs: bool,
    hf_reference: Callable[[str], Reference],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager, and every decode step from a CUDA graph: the graph check of the backends that
    serve no fp32 (FLASHINFER, FLASH_ATTN)."""
    reference = hf_reference("bfloat16")
    if graphs:
        ours = _graphed_tokens(backend, "bfloat16", reference.prompts, monkeypatch)
    else:
        ours = _tokens(backend, "bfloat16", True, reference.prompts)
    assert [len(tokens) for tokens in ours] == [NEW_TOKENS] * len(ours)
    assert_parts_only_at_rounding(reference, ours, BF16_MAX_STEPS)


@pytest.mark.parametrize("backend", backend_names())
def test_fp32_piecewise_replays_of_prompt_steps_give_hfs_tokens(
    backend: str, hf_reference: Callable[[str], Reference], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps that carry prompts (here chunks of 256 tokens beside decodes) from the piecewise
    graphs of their token count, attention eager between the pieces."""
    _skip_unless_graphed(backend, "float32")
    reference = hf_reference("float32")
    settings = ENGINE | {"max_num_batched_tokens": 256}
    llm = LLM(MODEL, dtype="float32", attention_backend=backend, **settings)
    pieces = llm.llm_engine.executor.driver_runner.piecewise_graphs
    assert pieces is not None and pieces.max_num_tokens == 256
    sizes: list[int] = []
    run = pieces.run

    def counted(token_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sizes.append(len(token_ids))
        return run(token_ids, *args, **kwargs)

    monkeypatch.setattr(pieces, "run", counted)
    try:
        tokens = engine_tokens(llm, reference.prompts)
    finally:
        llm.shutdown()
    assert len(sizes) >= 3 and sizes[0] == 256  # the prompts' 687 tokens take three steps
    assert tokens == reference.tokens
