"""Without a GPU, the LoRA Triton kernels run on the CPU through Triton's interpreter; it must be
switched on before any kernel is decorated (`attnserve.lora.triton_ops` is imported lazily)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
