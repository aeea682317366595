"""Host data onto the device without synchronising the stream.

`torch.tensor(values, device="cuda")` and `tensor.to("cuda")` copy synchronously: the host waits
until the GPU has finished everything queued before the copy, so a step prepared while the
previous one runs (async scheduling, CUDA-graph replays) would stall on every such copy. Copies
with `non_blocking=True` from ordinary (pageable) host memory are staged by the driver before
the call returns, so the source may be dropped at once, and they stay in stream order, so the
kernels after them see the data. Use these for every per-step host-to-device copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`, copied without waiting for the work queued there."""
    return host.to(device, non_blocking=True)


def device_tensor(
    values: Sequence[Any],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` (numbers, or nested sequences of them) on `device`,
    copied without waiting for the work queued there."""
    return to_device(torch.tensor(values, dtype=dtype), device)
