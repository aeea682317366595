"""`CPUGraphRunner`: small CPU decode steps replayed from CPU graphs
(`attnserve.native.graph`), one per batch-size bucket, as `CUDAGraphRunner` replays CUDA graphs.

At a few sequences a CPU decode step is mostly the Python around its native kernels (module
calls, allocations, argument checks: ~270 calls for the default model's 30 layers); a replay
makes only the kernel calls. Every size 1 to 8 (up to `max_num_seqs`) is its own bucket: a
padded row costs a whole row of every matmul (the default model's 8-row graph replays in ~1.3x
the time of its 5-row one, which a verify step of 1 + 4 tokens needs), and a bucket no step uses
is never captured. Layouts, static inputs and persistent metadata buffers are as on CUDA.
Nothing is captured at start-up: a bucket's first step is its capture (the capture runs that
step's forward on its own inputs), later steps replay it. A forward that computes with any
torch op (float weights, a bias add, a dense embedding) cannot be captured: that step reruns
eagerly, and from that bucket up steps run eagerly, as with `enforce_eager`. The kernels' calls
pass torch's thread count: when it changes, the graphs are captured again.
"""

from __future__ import annotations

import logging

import torch

from attnserve.attention import StepMetadata, set_forward_context
from attnserve.native.graph import GraphCaptureError, NativeGraph
from attnserve.worker.graph_runner import GraphRunner

logger = logging.getLogger(__name__)

MAX_GRAPH_SEQS = 8  # beyond, the packed layers hand batches to the BLAS (a torch op) anyway


class CPUGraphRunner(GraphRunner):
    _threads = 0  # torch's thread count when the graphs were captured (the kernels take it)

    @staticmethod
    def bucket_sizes(max_num_seqs: int) -> list[int]:
        return list(range(1, max_num_seqs + 1))

    def capture(self) -> None:
        """Nothing before the first steps: each bucket is captured by its first step."""

    def _replayed(self, size: int, metadata: StepMetadata) -> torch.Tensor:
        if torch.get_num_threads() != self._threads:  # captured calls pass the old count
            self.graphs.clear()
            self._threads = torch.get_num_threads()
        if size in self.graphs:
            return super()._replayed(size, metadata)
        ids, positions = self.input_ids[:size], self.positions[:size]
        graph = NativeGraph()
        try:
            with set_forward_context(metadata), graph.capture():
                hidden: torch.Tensor = self.model(ids, positions)
        except GraphCaptureError as error:
            logger.info("CPU graphs stop below %d sequences: %s", size, error)
            self.sizes = [s for s in self.sizes if s < size]
            with set_forward_context(metadata):  # the same writes again, then the rest
                return self.model(ids, positions)
        self.graphs[size] = (graph, hidden)
        logger.debug("captured a CPU graph of %d sequences: %d calls", size, graph.num_calls)
        return hidden
