"""CPU graphs (`attnserve.native_graph`): a capture records the native calls it makes and a
replay repeats them on whatever the captured buffers hold then; any torch op that computes is
refused by name, since a replay would not repeat it."""

from __future__ import annotations

import pytest
import torch

from attnserve.model.layers import cpu_ops
from attnserve.native_graph import (
    GraphCaptureError,
    NativeFunction,
    NativeGraph,
    refuse_in_capture,
)

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


def test_a_failing_call_fails_its_replay() -> None:
    status = [0]
    graph = NativeGraph()
    with graph.capture():
        NativeFunction("flaky", lambda: status[0])()
    graph.replay()
    status[0] = 3
    with pytest.raises(RuntimeError, match="flaky failed"):
        graph.replay()


def test_captures_do_not_nest_and_calls_outside_them_are_not_recorded() -> None:
    calls: list[int] = []
    function = NativeFunction("count", lambda: calls.append(1))
    graph = NativeGraph()
    function()
    with graph.capture():
        function()
        with pytest.raises(RuntimeError, match="already"), NativeGraph().capture():
            pass
    function()
    graph.replay()
    assert graph.num_calls == 1 and len(calls) == 4


def test_collectives_refuse_inside_a_capture() -> None:
    """A collective is no native call (and need not show as a torch op): a capture stops at it."""
    refuse_in_capture("an all-reduce")  # outside a capture: nothing happens
    with pytest.raises(GraphCaptureError, match="an all-reduce"), NativeGraph().capture():
        refuse_in_capture("an all-reduce")
