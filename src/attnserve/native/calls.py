"""CPU graphs: the native kernel calls of one forward recorded once and replayed without the
Python around them, as a CUDA graph replays kernel launches.

A CPU decode step of a small model is mostly host work: at one sequence the default model's
30 layers make ~270 native calls, and the module calls, allocations and argument checks between
them cost more than the kernels' own time. Kernels called through `NativeFunction` (every
ctypes entry point of the libraries `build` loads) append their call, arguments as passed, to
the graph being captured; `NativeGraph.replay` repeats those calls in order, so replaying reads
the same input buffers and writes the same output buffers as the captured forward did. The
replay runs in C (`graph.c`): each kernel has a `_packed` entry point taking its arguments as
int64 slots (`native_packed.h`), packed once after the capture, so a replay costs one ctypes
call instead of ~3 us for each of the ~270.

A capture is refused (`GraphCaptureError`, naming the op) when the forward computes anything
with a torch op instead of a native call: a replay would not repeat it. Only views (ops whose
outputs share an input's memory: a `contiguous` or `reshape` that copies is refused) and
allocations may run; the tensors allocated during the capture are kept alive by the graph,
since the recorded calls hold their addresses. A model collective across ranks (which need not
show as a torch op) refuses too, through the check this module adds to the collectives.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import struct
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnserve.distributed.communication import add_collective_check
from attnserve.native.build import load_native
from attnserve.profiling import NATIVE_RANGE, marked

_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
}


class _Capturing(threading.local):
    graph: NativeGraph | None = None  # the graph this thread is capturing


_capturing = _Capturing()


class GraphCaptureError(RuntimeError):
    """The forward did something a replay of its native calls would not repeat."""


def _refuse_in_capture(what: str) -> None:
    """GraphCaptureError while this thread captures a CPU graph: for work that is no native
    call and may not show as a torch op (a collective)."""
    if _capturing.graph is not None:
        raise GraphCaptureError(f"{what} cannot be replayed from a CPU graph")


add_collective_check(_refuse_in_capture)  # added on import: no capture runs before it


class NativeFunction:
    """Kernel `name` of a built library (its argtypes set), returning an int status (0: done) or
    nothing (restype None), that a capture records; `name_packed` is its entry point for
    replays (native_packed.h)."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        self.name = name
        self._function = getattr(library, name)
        self.packed_address = int(
            ctypes.cast(getattr(library, f"{name}_packed"), ctypes.c_void_p).value or 0
        )
        self._floats = [i for i, t in enumerate(self._function.argtypes) if t is ctypes.c_float]

    def __call__(self, *args: Any) -> int:
        graph = _capturing.graph
        if graph is not None:
            graph.record(self, args)
        with marked(NATIVE_RANGE):  # a profile's breakdown times native calls apart
            return self.run(args)

    def run(self, args: tuple[Any, ...]) -> int:
        """The call itself, never recorded: its status (0 for a function returning nothing)."""
        status = self._function(*args)
        return 0 if status is None else int(status)

    def pack(self, args: tuple[Any, ...]) -> list[int]:
        """`args` as the packed entry point's int64 slots (floats as their float32 bits)."""
        slots = [0 if a is None else int(a) for a in args]
        for i in self._floats:
            slots[i] = struct.unpack("<i", struct.pack("<f", args[i]))[0]
        return slots


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
        if _capturing.graph is not None:
            raise RuntimeError("a CPU graph is being captured already")
        self._calls.clear()
        _capturing.graph = self
        try:
            with _CaptureGuard(self):
                yield
        finally:
            _capturing.graph = None
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
