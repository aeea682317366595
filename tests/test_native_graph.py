"""CPU graphs (`NativeGraph`, `attnserve.worker.graphs.cpu`): a capture records the native calls
it makes and a replay repeats them on whatever the captured buffers hold then; any torch op that
computes is refused by name, since a replay would not repeat it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from attnserve.attention import get_backend_cls
from attnserve.model.layers import cpu_ops
from attnserve.model.layers.layernorm import RMSNorm
from attnserve.model.layers.rotary_embedding import RotaryEmbedding
from attnserve.model.quantization.gguf_blocks import from_blocks
from attnserve.model.quantization.gguf_cpu import NativeWeight
from attnserve.worker import graphs
from attnserve.worker.graphs.cpu import (
    MAX_GRAPH_SEQS,
    CPUGraphRunner,
    GraphCaptureError,
    NativeGraph,
)

Q8_0 = GGMLQuantizationType.Q8_0

native = pytest.mark.skipif(
    cpu_ops.cpu_ops_library() is None, reason="native CPU ops not built here (AVX2, compiler)"
)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight


@native
def test_a_replay_computes_on_the_inputs_of_its_time() -> None:
    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    graph = NativeGraph()
    with graph.capture():
        normed, summed = cpu_ops.fused_add_rms_norm(x, x, weight, 1e-6)
        activated = cpu_ops.silu_and_mul(summed)
    assert graph.num_calls == 2
    x.copy_(torch.randn(3, 64))
    graph.replay()
    torch.testing.assert_close(summed, 2 * x)
    torch.testing.assert_close(normed, _rms_norm(2 * x, weight), atol=2e-6, rtol=2e-6)
    gate, up = (2 * x).chunk(2, -1)
    torch.testing.assert_close(activated, torch.nn.functional.silu(gate) * up)


@native
def test_allocations_during_the_capture_outlive_it() -> None:
    """The recorded calls hold addresses: the graph keeps what the capture allocated."""
    x, weight = torch.randn(2, 32), torch.ones(32)
    graph = NativeGraph()
    with graph.capture():
        first = cpu_ops.rms_norm(x, weight, 1e-6)
        out = cpu_ops.rms_norm(first, weight, 1e-6)
    del first  # only the graph holds it now
    x.mul_(3.0)
    graph.replay()
    torch.testing.assert_close(out, _rms_norm(_rms_norm(x, weight), weight), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    ("step", "named"),
    [
        (lambda x: x + 1, "aten.add.Tensor"),
        (lambda x: x[:, :3].contiguous(), r"aten\.(contiguous|clone)"),  # may alias; copies
        (lambda x: torch.nn.functional.embedding(torch.tensor([0]), x), "aten"),
    ],
)
@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
def test_a_torch_op_that_computes_is_refused_by_name(
    step: object, named: str, inference: bool
) -> None:
    x = torch.randn(4, 8)
    graph = NativeGraph()
    refused = pytest.raises(GraphCaptureError, match=named)
    with torch.inference_mode(inference), refused, graph.capture():
        step(x)  # type: ignore[operator]


def test_views_and_allocations_are_allowed() -> None:
    x = torch.randn(4, 8)
    graph = NativeGraph()
    with graph.capture():
        parts = x.split([3, 5], -1)
        viewed = x.view(2, 16)[1:].contiguous().reshape(-1)  # already contiguous: aliases
    assert parts[1].data_ptr() == x.data_ptr() + 3 * x.element_size()
    assert viewed.data_ptr() == x.data_ptr() + 16 * x.element_size()


@native
def test_a_failing_call_fails_its_replay() -> None:
    """A kernel's nonzero status stops the replay: an embedding row id gone out of range."""
    values = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    table = NativeWeight(from_blocks("Q8_0", quantize(values, Q8_0), (4, 32)))
    ids = torch.tensor([0, 3])
    graph = NativeGraph()
    with graph.capture():
        rows = table.dequantize_rows(ids)
    ids[1] = 2
    graph.replay()
    assert torch.equal(rows, table.dequantize_rows(torch.tensor([0, 2])))
    ids[1] = 4
    with pytest.raises(RuntimeError, match="gguf_dequantize failed"):
        graph.replay()


@native
def test_captures_do_not_nest_and_calls_outside_them_are_not_recorded() -> None:
    x, weight = torch.randn(2, 16), torch.ones(16)
    graph = NativeGraph()
    cpu_ops.rms_norm(x, weight, 1e-6)
    with graph.capture():
        out = cpu_ops.rms_norm(x, weight, 1e-6)
        with pytest.raises(RuntimeError, match="already"), NativeGraph().capture():
            pass
    cpu_ops.rms_norm(x, weight, 1e-6)
    assert graph.num_calls == 1
    x.mul_(2.0)
    graph.replay()
    torch.testing.assert_close(out, _rms_norm(x, weight), atol=2e-6, rtol=2e-6)


def test_an_empty_graph_replays_as_nothing() -> None:
    graph = NativeGraph()
    with graph.capture():
        torch.empty(3)
    graph.replay()
    assert graph.num_calls == 0


@native
def test_a_qwen3_attention_input_step_captures_at_any_batch() -> None:
    """q/k head norms, rotary and v's copy of several tokens: native calls only (no copy of the
    strided qkv split), so a decode step of Qwen3 layers can be replayed at batches above 1."""
    rope = RotaryEmbedding(16, 64, 10000.0)
    norms = (RMSNorm(16, 1e-6), RMSNorm(16, 1e-6))
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16)
    positions = torch.tensor([4, 9, 1])
    graph = NativeGraph()
    with torch.inference_mode():
        with graph.capture():
            captured = rope.forward_qkv(positions, qkv.split([64, 32, 32], -1), norms)
        qkv.copy_(torch.randn(3, 128))
        graph.replay()
        expected = rope.forward_qkv(positions, qkv.split([64, 32, 32], -1), norms)
    assert all(torch.equal(a, b) for a, b in zip(captured, expected, strict=True))


def test_only_a_model_on_one_rank_gets_cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model split over ranks calls collectives, which are no native calls (a replay would
    skip them): it gets no CPU graph runner and runs eagerly. On one rank it gets one, with a
    bucket per size up to 16, then sparser up to MAX_GRAPH_SEQS."""
    backend, cpu = get_backend_cls("CPU_NATIVE"), torch.device("cpu")
    runner = graphs.capture_decode_graphs(torch.nn.Identity(), backend, {}, 16, 2, cpu)
    assert isinstance(runner, graphs.CPUGraphRunner)
    assert runner.sizes == list(range(1, 17))  # max_num_seqs 16: every size a bucket
    assert CPUGraphRunner.bucket_sizes(MAX_GRAPH_SEQS)[-5:] == [16, 24, 32, 48, MAX_GRAPH_SEQS]
    monkeypatch.setattr(graphs, "get_tensor_model_parallel_world_size", lambda: 2)
    assert graphs.capture_decode_graphs(torch.nn.Identity(), backend, {}, 16, 2, cpu) is None
