"""`CPUGraphRunner`: small CPU decode steps replayed from CPU graphs (`attnserve.native_graph`),
one per batch-size bucket, as `CUDAGraphRunner` replays CUDA graphs.

At a few sequences a CPU decode step is mostly the Python around its native kernels (module
calls, allocations, argument checks: ~270 calls for the default model's 30 layers); a replay
makes only the kernel calls. Buckets 1, 2, 4 and 8 (up to `max_num_seqs`) are captured, the
same padded layouts, static inputs and persistent metadata buffers as on CUDA. A forward that
computes with any torch op (float weights, a bias add, a dense embedding) cannot be captured:
from the first bucket refused on, steps run eagerly, as with `enforce_eager`.
"""

from __future__ import annotations

import logging
import time

import torch

from attnserve.attention import set_forward_context
from attnserve.native_graph import GraphCaptureError, NativeGraph
from attnserve.worker.cuda_graph import CUDAGraphRunner

logger = logging.getLogger(__name__)

MAX_GRAPH_SEQS = 8  # beyond, the packed layers hand batches to the BLAS (a torch op) anyway


class CPUGraphRunner(CUDAGraphRunner):
    def capture(self) -> None:
        """Capture the buckets in increasing size, up to the first one refused."""
        started = time.perf_counter()
        for size in self.sizes:
            try:
                self._capture_native(size)
            except GraphCaptureError as error:
                logger.info("CPU graphs stop below %d sequences: %s", size, error)
                break
        self.sizes = list(self.graphs)
        if self.sizes:
            logger.info(
                "captured %d CPU graphs (decode batches up to %d) in %.2f s",
                len(self.sizes),
                self.max_num_seqs,
                time.perf_counter() - started,
            )

    @torch.inference_mode()
    def _capture_native(self, size: int) -> None:
        graph = NativeGraph()
        ids, positions = self.input_ids[:size], self.positions[:size]
        with set_forward_context(self._dummy_metadata(size)), graph.capture():
            hidden = self.model(ids, positions)
        self.graphs[size] = (graph, hidden)
