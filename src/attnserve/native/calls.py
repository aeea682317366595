"""`NativeFunction`: the Python entry point of one native kernel, whose calls can be recorded.

Every ctypes kernel of the libraries `build` loads is called through a `NativeFunction`. While
a thread records (`recording_calls`: a CPU graph's capture, `attnserve.worker.graphs.cpu`), each
call is handed to the recorder, arguments as passed, before it runs. A kernel also has a
`_packed` entry point taking its arguments as int64 slots (`native_packed.h`): `pack` gives a
call's slots and `packed_address` that entry point, so a recorded call can be made again from C
(`graph.c`) without Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from attnserve.profiling import NATIVE_RANGE, marked


class CallRecorder(Protocol):
    def record(self, function: NativeFunction, args: tuple[Any, ...]) -> None: ...


class _Recording(threading.local):
    recorder: CallRecorder | None = None  # what records this thread's native calls


_recording = _Recording()


@contextlib.contextmanager
def recording_calls(recorder: CallRecorder) -> Iterator[None]:
    """Inside, every native call of this thread is handed to `recorder` (and run)."""
    if _recording.recorder is not None:
        raise RuntimeError("this thread's native calls are being recorded already")
    _recording.recorder = recorder
    try:
        yield
    finally:
        _recording.recorder = None


class NativeFunction:
    """Kernel `name` of a built library (its argtypes set), returning an int status (0: done) or
    nothing (restype None), whose calls a recorder sees; `name_packed` is its entry point for
    replays (native_packed.h)."""

    def __init__(self, library: ctypes.CDLL, name: str) -> None:
        self.name = name
        self._function = getattr(library, name)
        self.packed_address = int(
            ctypes.cast(getattr(library, f"{name}_packed"), ctypes.c_void_p).value or 0
        )
        self._floats = [i for i, t in enumerate(self._function.argtypes) if t is ctypes.c_float]

    def __call__(self, *args: Any) -> int:
        recorder = _recording.recorder
        if recorder is not None:
            recorder.record(self, args)
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
