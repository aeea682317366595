"""Graphs: every way a step is replayed from a capture instead of run op by op, in one place.

- `base.GraphRunner`: decode-only steps, one graph per batch-size bucket, the step's layout
  padded to the bucket (`padding.pad_for_graph`) and its metadata written into the builders'
  persistent buffers (`padding.build_graph_metadata`); on CUDA `cuda.CUDAGraphRunner` (every
  bucket captured at start-up), on the CPU `cpu.CPUGraphRunner` (graphs of native kernel calls,
  `cpu.NativeGraph`, each bucket captured by its first step).
- `piecewise.PiecewiseGraphRunner`: on CUDA, steps that carry prompt tokens, from CUDA graphs of
  the model between its attention calls, per token-count bucket.

The model runner asks for them once, after its cache is bound (`capture_decode_graphs`, then on
CUDA `capture_piecewise_graphs`), and hands each step to the runner it fits; a backend that does
not declare `graphs`, or `enforce_eager`, gets none.
"""

from __future__ import annotations

import logging

import torch

from attnserve.attention import AttentionBackend, Builders
from attnserve.distributed import get_tensor_model_parallel_world_size
from attnserve.worker.graphs.base import GraphRunner
from attnserve.worker.graphs.cpu import MAX_GRAPH_SEQS, CPUGraphRunner
from attnserve.worker.graphs.cuda import CUDAGraphRunner
from attnserve.worker.graphs.padding import build_graph_metadata, pad_for_graph
from attnserve.worker.graphs.piecewise import PiecewiseGraphRunner

__all__ = [
    "CPUGraphRunner",
    "CUDAGraphRunner",
    "GraphRunner",
    "PiecewiseGraphRunner",
    "build_graph_metadata",
    "capture_decode_graphs",
    "capture_piecewise_graphs",
    "pad_for_graph",
]

logger = logging.getLogger(__name__)


def capture_decode_graphs(
    model: torch.nn.Module,
    backend: type[AttentionBackend],
    builders: Builders,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    device: torch.device,
) -> GraphRunner | None:
    """The decode graph runner of this device (CUDA, or the CPU for up to MAX_GRAPH_SEQS
    sequences), captured as far as it captures at start-up; None where there are no graphs."""
    if device.type not in ("cuda", "cpu"):
        return None
    if not backend.capabilities.graphs:
        logger.info("no graphs: backend %s does not support them", backend.get_name())
        return None
    kind: type[GraphRunner] = CUDAGraphRunner
    if device.type == "cpu":
        if get_tensor_model_parallel_world_size() > 1:  # its collectives are no native calls
            logger.info("no CPU graphs: the model is split over ranks")
            return None
        kind, max_num_seqs = CPUGraphRunner, min(max_num_seqs, MAX_GRAPH_SEQS)
    runner = kind(model, builders, max_num_seqs, max_blocks_per_seq, device)
    runner.capture()
    return runner


def capture_piecewise_graphs(
    model: torch.nn.Module, max_num_batched_tokens: int, device: torch.device
) -> PiecewiseGraphRunner | None:
    """The piecewise CUDA graphs of steps with prompts, all captured; None where the model's
    forward cannot be captured (those steps run eagerly)."""
    runner = PiecewiseGraphRunner(model, max_num_batched_tokens, device)
    try:
        runner.capture()
    except RuntimeError as error:
        torch.cuda.synchronize(device)
        logger.warning("no piecewise CUDA graphs (steps with prompts run eagerly): %s", error)
        return None
    return runner
