"""The device an engine runs on, checked up front: `resolve_device` turns the `device` argument
into a torch device this process can use, or a ValueError naming the argument and the fix."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """ "auto" (CUDA when available), "cpu", "cuda" or "cuda:N" as a torch device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r}: N in 'cuda:N' is a GPU number") from None
    if device.type == "cuda":
        _check_cuda_device(device)
    return device


def _check_cuda_device(device: torch.device) -> None:
    """ValueError unless `device` is a GPU this process can use."""
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"device {str(device)!r}: this torch ({torch.__version__}) is built without CUDA; "
            "use device 'cpu' or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"device {str(device)!r}: no GPU is visible; use device 'cpu'")
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device {str(device)!r}: this host has {count} GPU(s), cuda:0..{count - 1}"
        )
