"""`CUDAGraphRunner`: decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels; replaying them as one captured graph removes
the per-launch host cost. Graphs are captured once at start-up for buckets 1, 2, 4, 8, 16, 24,
... (sparser above 256) up to `max_num_seqs` (largest first, all in one memory pool). A step of
n decodes runs the smallest bucket >= n: its layout is padded to the bucket
(`pad_for_cuda_graph`), its token ids and the padded layout's positions go into static input
buffers, each of the model's metadata builders writes the padded layout into its persistent
buffers (`build_for_cuda_graph`), the graph replays, and the first n rows of the captured final
hidden states are the step's (the LM head runs outside the graph, on those rows only, so the
graphs hold no vocabulary-sized buffers). Only backends whose capabilities declare `cuda_graphs`
are captured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from attnserve.attention import (
    Builders,
    StepLayout,
    StepMetadata,
    build_graph_metadata,
    build_step_layout,
    pad_for_cuda_graph,
    set_forward_context,
)

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class Graph(Protocol):
    """A captured forward (a CUDA graph, or a CPU one: `attnserve.native.graph`)."""

    def replay(self) -> None: ...


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, then every multiple of 8 to 256, of 16 to 512 and of 32 beyond
    (above 128 a step pads by under 7%), up to and including max_num_seqs."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, max_num_seqs, 32)]
    return [*(s for s in sizes if s < max_num_seqs), max_num_seqs]


def capture_largest_first(sizes: list[int], capture_one: Callable[[int, Any], Any]) -> float:
    """Capture each bucket of `sizes`, largest first, all in one memory pool (`capture_one(size,
    pool)` returns the pool, None before the first); the seconds it took."""
    started = time.perf_counter()
    pool = None
    for size in reversed(sizes):
        pool = capture_one(size, pool)
    torch.cuda.synchronize()
    return time.perf_counter() - started


class CUDAGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        builders: Builders,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.builders = builders
        self.sizes = capture_sizes(max_num_seqs)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        for builder in builders.values():
            builder.init_cuda_graph_buffers(max_num_seqs, max_blocks_per_seq)

    @property
    def max_num_seqs(self) -> int:
        """The largest bucket (0 when there is none)."""
        return self.sizes[-1] if self.sizes else 0

    def capture(self) -> None:
        """Capture every bucket. The dummy steps write only block 0 (slot -1 elsewhere)."""
        seconds = capture_largest_first(self.sizes, self._capture_one)
        logger.info(
            "captured %d CUDA graphs (decode batches up to %d) in %.1f s",
            len(self.sizes),
            self.max_num_seqs,
            seconds,
        )

    def _capture_one(self, size: int, pool: Any) -> Any:
        ids, positions = self.input_ids[:size], self.positions[:size]
        with set_forward_context(self._dummy_metadata(size)):
            self.model(ids, positions)  # compiles the kernels before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with set_forward_context(self._dummy_metadata(size)), torch.cuda.graph(graph, pool=pool):
            hidden = self.model(ids, positions)
        self.graphs[size] = (graph, hidden)
        return graph.pool()

    def _dummy_metadata(self, size: int) -> StepMetadata:
        """A decode step of `size` sequences at position 1, both tokens in block 0 (the table
        names block 0 twice, so it holds them whatever the block size)."""
        block_size = next(iter(self.builders)).block_size
        layout = build_step_layout([[0, 0]] * size, [1] * size, [1] * size, block_size)
        return build_graph_metadata(self.builders, pad_for_cuda_graph(layout, size))

    def run(
        self,
        token_ids: torch.Tensor,
        layout: StepLayout,
        carried: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [n, hidden_size] of a decode-only step of n <= max_num_seqs
        sequences, whose host token ids are `token_ids` [n]. `carried` (rows, token ids on the
        device) overrides those rows' token ids."""
        num_seqs = layout.num_seqs
        size = next(s for s in self.sizes if s >= num_seqs)
        padded = pad_for_cuda_graph(layout, size)
        metadata = build_graph_metadata(self.builders, padded)
        host = torch.zeros(2, size, dtype=torch.int64)
        host[0, :num_seqs] = token_ids
        host[1] = padded.token_pos
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        if carried is not None:
            self.input_ids[carried[0]] = carried[1]
        return self._replayed(size, metadata)[:num_seqs]

    def _replayed(self, size: int, metadata: StepMetadata) -> torch.Tensor:
        """The bucket's captured output after replaying its graph on the loaded inputs."""
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden
