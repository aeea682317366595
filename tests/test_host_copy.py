"""Per-step host-to-device copies never synchronise the stream: `attnserve.host_copy` builds the
same tensors as `torch.tensor` / `.to`, and the step path (worker, sampler, backends) uses it
rather than the synchronous forms."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from attnserve.host_copy import device_tensor, to_device

SRC = Path(__file__).resolve().parents[1] / "src" / "attnserve"
STEP_PATH = [SRC / "worker", SRC / "model" / "sampler.py", SRC / "attention"]
SYNCHRONOUS = re.compile(r"torch\.tensor\([^)]*device=|\.to\((self\.)?device\)")


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([3, 1, 2], None),
        ([0.5, 2.0], torch.float32),
        ([True, False], None),
        ([[1, 2], [3, 4]], None),
    ],
)
def test_device_tensor_is_torch_tensor(values: list, dtype: torch.dtype | None) -> None:
    made = device_tensor(values, "cpu", dtype)
    expected = torch.tensor(values, dtype=dtype)
    assert made.dtype == expected.dtype and torch.equal(made, expected)


def test_to_device_keeps_values_and_dtype() -> None:
    host = torch.arange(6, dtype=torch.int32).view(2, 3)
    assert torch.equal(to_device(host, torch.device("cpu")), host)


def test_the_step_path_makes_no_synchronous_copies() -> None:
    files = [p for root in STEP_PATH for p in ([root] if root.is_file() else root.rglob("*.py"))]
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SYNCHRONOUS.search(line)
    ]
    assert found == []
