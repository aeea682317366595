"""`GraphRunner`: decode steps replayed from captured graphs, one graph per batch-size bucket,
whatever the device (`CUDAGraphRunner` captures CUDA graphs, `CPUGraphRunner` CPU ones); the
bucket sizes and the largest-first capture the CUDA runners share.

A decode step launches hundreds of small kernels; replaying them as one captured graph removes
the per-launch host cost. Buckets are 1, 2, 4, 8, 16, 24, ... (sparser above 256) up to
`max_num_seqs` (`capture_sizes`). A step of n decodes runs the smallest bucket >= n: its layout
is padded to the bucket (`pad_for_graph`), its token ids and the padded layout's positions go
into static input buffers, each of the model's metadata builders writes the padded layout into
its persistent buffers (`build_for_graph`, after `init_graph_buffers` once), the bucket's graph
replays, and the first n rows of the captured final hidden states are the step's (the LM head
runs outside the graph, on those rows only, so the graphs hold no vocabulary-sized buffers).
Only backends whose capabilities declare `graphs` are captured. When and how a bucket is
captured is the subclass's: `capture` and `_replayed`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch

from attnserve.attention import Builders, StepLayout, StepMetadata
from attnserve.worker.graphs.padding import build_graph_metadata, pad_for_graph


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class Graph(Protocol):
    """A captured forward (a CUDA graph, or a CPU one: `NativeGraph`)."""

    def replay(self) -> None: ...


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, then every multiple of 8 to 256, of 16 to 512 and of 32 beyond
    (above 128 a step pads by under 7%), up to and including max_num_seqs."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 512, 16), *range(512, max_num_seqs, 32)]
    return [*(s for s in sizes if s < max_num_seqs), max_num_seqs]


def capture_largest_first(sizes: list[int], capture_one: Callable[[int, Any], Any]) -> float:
    """Capture each bucket of `sizes`, largest first, all in one memory pool (`capture_one(size,
    pool)` returns the pool, None before the first); the seconds it took (CUDA captures: it
    waits for the device)."""
    started = time.perf_counter()
    pool = None
    for size in reversed(sizes):
        pool = capture_one(size, pool)
    torch.cuda.synchronize()
    return time.perf_counter() - started


class GraphRunner(ABC):
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
        self.sizes = self.bucket_sizes(max_num_seqs)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        for builder in builders.values():
            builder.init_graph_buffers(max_num_seqs, max_blocks_per_seq)

    @staticmethod
    def bucket_sizes(max_num_seqs: int) -> list[int]:
        """The buckets for steps of up to `max_num_seqs` sequences (`capture_sizes`)."""
        return capture_sizes(max_num_seqs)

    @property
    def max_num_seqs(self) -> int:
        """The largest bucket (0 when there is none)."""
        return self.sizes[-1] if self.sizes else 0

    @abstractmethod
    def capture(self) -> None:
        """Capture what is captured at start-up, before the first step."""

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
        padded = pad_for_graph(layout, size)
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
