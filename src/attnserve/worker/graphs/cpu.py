"""CPU graphs: `NativeGraph` (one forward's native kernel calls, recorded once and replayed from
C without the Python around them) and `CPUGraphRunner` (small CPU decode steps replayed from
them, one per batch-size bucket, as `CUDAGraphRunner` replays CUDA graphs).

At a few sequences a CPU decode step is mostly the Python around its native kernels (module
calls, allocations, argument checks: ~270 calls for the default model's 30 layers, each costing
more than the kernel's own time). A capture records every `NativeFunction` call
(`attnserve.native.calls`), arguments as passed; a replay makes those calls again in order, in
C (`native/graph.c`, through each kernel's `_packed` entry point: one ctypes call for the
whole graph), so it reads the same input buffers and writes the same output buffers as the
captured forward did.

A capture is refused (`GraphCaptureError`, naming the op) when the forward computes anything
with a torch op instead of a native call: a replay would not repeat it. Only views (ops whose
outputs share an input's memory: a `contiguous` or `reshape` that copies is refused) and
allocations may run; the tensors allocated during the capture are kept alive by the graph,
since the recorded calls hold their addresses. (A model split over ranks is never captured: its
collectives are no native calls; `capture_decode_graphs` makes no CPU graphs there.)

Every size 1 to 16 is its own bucket, then 24, 32, 48 and 64 (`MAX_GRAPH_SEQS`; up to
`max_num_seqs`): a padded row costs a whole row of every matmul (the default model's 8-row graph
replays in ~1.3x the time of its 5-row one, which a verify step of 1 + 4 tokens needs), and a
bucket no step uses is never captured. Batched decode steps are graphs too: at 16 sequences the
Python around an eager step's ~270 native calls was still ~40% of its time. Layouts,
static inputs and persistent metadata buffers are as on CUDA. Nothing is captured at start-up:
a bucket's first step is its capture (the capture runs that step's forward on its own inputs),
later steps replay it. A forward that cannot be captured (float weights, a bias add, a dense
embedding) reruns eagerly, and from that bucket up steps run eagerly, as with `enforce_eager`.
The kernels' calls pass torch's thread count: when it changes, the graphs are captured again.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnserve.attention import StepMetadata, set_forward_context
from attnserve.native.build import load_native
from attnserve.native.calls import NativeFunction, recording_calls
from attnserve.worker.graphs.base import GraphRunner

logger = logging.getLogger(__name__)

# the largest bucket; each size its own bucket up to EVERY_SIZE, then these
MAX_GRAPH_SEQS = 64
EVERY_SIZE, LARGER_BUCKETS = 16, (24, 32, 48, 64)

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
}


class GraphCaptureError(RuntimeError):
    """The forward did something a replay of its native calls would not repeat."""


@functools.cache
def _replayer() -> Any:
    """`replay_calls` of graph.c (a ctypes function)."""
    library = load_native("graph.c")
    if library is None:
        raise RuntimeError("the native replay of CPU graphs is not available here")
    library.replay_calls.argtypes = [ctypes.c_int64, *(ctypes.c_void_p,) * 3]
    library.replay_calls.restype = ctypes.c_int64
    return library.replay_calls


class NativeGraph:
    """One captured forward: its native calls in order, and the tensors they address."""

    def __init__(self) -> None:
        self._calls: list[tuple[NativeFunction, tuple[Any, ...]]] = []
        self._tensors: list[torch.Tensor] = []
        self._program: tuple[torch.Tensor, ...] = ()  # function addresses, slot starts, slots

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def record(self, function: NativeFunction, args: tuple[Any, ...]) -> None:
        self._calls.append((function, args))

    def keep(self, tensor: torch.Tensor) -> None:
        self._tensors.append(tensor)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Inside, native calls are recorded (and run) and torch ops other than views and
        allocations raise GraphCaptureError."""
        self._calls.clear()
        with recording_calls(self), _CaptureGuard(self):
            yield
        self._program = self._packed()

    def _packed(self) -> tuple[torch.Tensor, ...]:
        packed = [function.pack(args) for function, args in self._calls]
        starts = [0, *itertools.accumulate(len(slots) for slots in packed)][:-1]
        addresses = [function.packed_address for function, _ in self._calls]
        slots = list(itertools.chain.from_iterable(packed))
        return tuple(torch.tensor(v, dtype=torch.int64) for v in (addresses, starts, slots))

    def replay(self) -> None:
        """Repeat the captured calls; RuntimeError where one fails (a kernel's status)."""
        if not self._calls:
            return
        failed = _replayer()(len(self._calls), *(t.data_ptr() for t in self._program))
        if failed:
            name = self._calls[failed - 1][0].name
            raise RuntimeError(f"native kernel {name} failed in a replayed graph")


class _CaptureGuard(TorchDispatchMode):
    def __init__(self, graph: NativeGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not func.is_view and func not in _ALLOCATIONS:
            raise GraphCaptureError(f"{func} is not a native kernel call")
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.graph.keep(out)
        elif not _aliases(out, args):  # an op that may alias (contiguous, reshape) copied
            raise GraphCaptureError(f"{func} copied its input (not a native kernel call)")
        return out


def _aliases(out: Any, args: tuple[Any, ...]) -> bool:
    """Whether every tensor of `out` shares its memory with a tensor of `args`."""
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if _is_tensor(t)}
    outputs = [t for t in tree_leaves(out) if _is_tensor(t)]
    return all(t.untyped_storage().data_ptr() in inputs for t in outputs)


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


class CPUGraphRunner(GraphRunner):
    _threads = 0  # torch's thread count when the graphs were captured (the kernels take it)

    @staticmethod
    def bucket_sizes(max_num_seqs: int) -> list[int]:
        sizes = [*range(1, EVERY_SIZE + 1), *LARGER_BUCKETS]
        return [*(s for s in sizes if s < max_num_seqs), max_num_seqs]

    def capture(self) -> None:
        """Nothing before the first steps: each bucket is captured by its first step."""

    def _replayed(self, size: int, metadata: StepMetadata) -> torch.Tensor:
        if torch.get_num_threads() != self._threads:  # captured calls pass the old count
            self.graphs.clear()
            self._threads = torch.get_num_threads()
        if size in self.graphs:
            return super()._replayed(size, metadata)
        ids, positions = self.input_ids[:size], self.positions[:size]
        graph = NativeGraph()
        try:
            with set_forward_context(metadata), graph.capture():
                hidden: torch.Tensor = self.model(ids, positions)
        except GraphCaptureError as error:
            logger.info("CPU graphs stop below %d sequences: %s", size, error)
            self.sizes = [s for s in self.sizes if s < size]
            with set_forward_context(metadata):  # the same writes again, then the rest
                return self.model(ids, positions)
        self.graphs[size] = (graph, hidden)
        logger.debug("captured a CPU graph of %d sequences: %d calls", size, graph.num_calls)
        return hidden
