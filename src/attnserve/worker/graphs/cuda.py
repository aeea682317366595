"""`CUDAGraphRunner`: decode steps replayed from CUDA graphs, one graph per batch-size bucket
(the buckets, inputs and replay: `GraphRunner`).

Every bucket is captured once at start-up, largest first, all in one memory pool: each capture
first runs its dummy step eagerly (which compiles the kernels), then records it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from attnserve.attention import StepMetadata, build_step_layout, set_forward_context
from attnserve.worker.graphs.base import GraphRunner, capture_largest_first
from attnserve.worker.graphs.padding import build_graph_metadata, pad_for_graph

logger = logging.getLogger(__name__)


class CUDAGraphRunner(GraphRunner):
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
        names block 0 twice, so it holds them whatever the block size), in every KV-cache
        group."""
        block_size = next(iter(self.builders)).block_size
        tables = [[0, 0]] * size
        num_groups = 1 + max(spec.kv_cache_group for spec in self.builders)
        layout = build_step_layout(
            tables, [1] * size, [1] * size, block_size, [tables] * (num_groups - 1)
        )
        return build_graph_metadata(self.builders, pad_for_graph(layout, size))
