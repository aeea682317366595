"""Without a GPU, Triton kernels (the model's fused ops) run on the CPU through Triton's
interpreter; it must be switched on before any kernel is decorated, i.e. before
`attnserve.model.layers.fused_ops` is imported (the layers import it lazily, on CUDA only)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
