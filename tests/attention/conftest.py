"""Which backends and devices the conformance suite runs here."""

from __future__ import annotations

import os

import pytest
import torch

from attnserve.attention import AttentionBackend, backend_names, get_backend_cls
from examples.one_file_backend import OneFileBackend

# Without a GPU, Triton kernels run on the CPU through Triton's interpreter; it must be switched
# on before any kernel is decorated, i.e. before a Triton-based backend is imported (the imports
# above load no backend module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The documented one-file example backend runs the suite too: it proves the suite is
# layout-agnostic and that the example in docs/attention.md is right.
EXAMPLES = {"ONE_FILE": OneFileBackend}


def _devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _runnable() -> list[tuple[str, str]]:
    pairs = []
    for name in [*backend_names(), *EXAMPLES]:
        for device in _devices():
            pairs.append((name, device))
    return pairs


@pytest.fixture(params=_runnable(), ids=lambda p: f"{p[0]}-{p[1]}")
def backend_on_device(request: pytest.FixtureRequest) -> tuple[type[AttentionBackend], str]:
    name, device = request.param
    try:
        backend = EXAMPLES.get(name) or get_backend_cls(name)
    except ImportError as error:
        pytest.skip(f"{name} cannot be imported here: {error}")
    missing = backend.unavailable_reason()
    if missing or device not in backend.capabilities.devices:
        pytest.skip(f"{name} does not run on {device} here: {missing or 'device not supported'}")
    return backend, device
