"""`DeviceBlockTable`: the persistent batch's block tables kept on the device as well.

The input batch keeps every held sequence's block table in a host array (a row per slot); on an
accelerator this keeps the same rows in a device tensor (int32, the kernels' type), rewritten
only where a plan changed them (new sequences, appended or replaced blocks). A step's table is
then a gather of its slots' rows on the device: the full [B, W] table never crosses the bus.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from attnserve.host_copy import to_device


class DeviceBlockTable:
    def __init__(self, max_blocks: int, device: torch.device) -> None:
        self.device = device
        self.rows = torch.zeros(0, max_blocks, dtype=torch.int32, device=device)

    def grow(self, capacity: int) -> None:
        grown = self.rows.new_zeros(capacity, self.rows.shape[1])
        grown[: len(self.rows)] = self.rows
        self.rows = grown

    def write(self, slots: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]) -> None:
        """Set the slots' rows (`rows`: [len(slots), max_blocks] block ids) in one transfer."""
        if not len(slots):
            return
        index = to_device(torch.from_numpy(slots), self.device)
        self.rows[index] = to_device(torch.from_numpy(rows.astype(np.int32)), self.device)

    def gather(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[len(slots), width] int32: the first `width` entries of the rows of `slots` (on the
        device)."""
        return self.rows[slots, :width]
