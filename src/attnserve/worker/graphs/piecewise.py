"""`PiecewiseGraphRunner`: steps that carry prompt tokens, replayed from CUDA graphs of the model
between its attention calls (vLLM's piecewise graphs), one set per token-count bucket.

A decode step's attention fits one captured graph (its metadata lives in persistent buffers of
a fixed shape); a step with prompts does not, since its attention launches depend on the
prompts' lengths. Everything else in the forward (embedding, norms, projections, rotary, MLPs,
collectives) only sees a flat batch of tokens, so it is captured per bucket of token counts
(`piecewise_sizes`: 23 from 16 to 2,048 tokens, capped by the step budget), split at each
attention layer: the capture runs the forward once with every attention layer handing its
query, key and value to a split (`splitting_at_attention`), which copies them into static
buffers, ends the current graph and starts the next one, returning a static buffer as the
layer's output. A replay runs the pieces in
order with the attention layers between them, eagerly, on the step's real metadata (built by the
backend's builder as for an eager step) and on the real tokens only; the padding tokens of the
bucket (token 0 at position 0) pass through the other pieces and are dropped. A step of more
tokens than the largest bucket runs eagerly: there the device's work dwarfs the launches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.attention import StepMetadata, set_forward_context, splitting_at_attention
from attnserve.worker.graphs.base import capture_largest_first

logger = logging.getLogger(__name__)

MAX_PIECEWISE_TOKENS = 2048


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token buckets: every 16 to 64, 96, every 32 to 256, every 64 to 512, every 128 to 1,024
    and every 256 to 2,048 (from 96 tokens up a step pads by at most a third), up to and
    including the budget (capped at MAX_PIECEWISE_TOKENS)."""
    top = min(max_num_batched_tokens, MAX_PIECEWISE_TOKENS)
    sizes = [
        *range(16, 96, 16),
        *range(96, 256, 32),
        *range(256, 512, 64),
        *range(512, 1024, 128),
        *range(1024, MAX_PIECEWISE_TOKENS, 256),
    ]
    return [*(s for s in sizes if s < top), top]


@dataclass(frozen=True)
class _Buffers:
    """Static query/key/value/output rows of the attention layers of one shape, at the largest
    bucket (a bucket uses their first rows)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor


@dataclass(frozen=True)
class _Pieces:
    """One bucket: its graphs, the attention layer after each graph but the last (and that
    layer's buffers), and the forward's static output."""

    graphs: list[torch.cuda.CUDAGraph]
    layers: list[tuple[torch.nn.Module, _Buffers]]
    hidden: torch.Tensor


class PiecewiseGraphRunner:
    def __init__(
        self, model: torch.nn.Module, max_num_batched_tokens: int, device: torch.device
    ) -> None:
        self.model = model
        self.sizes = piecewise_sizes(max_num_batched_tokens)
        self.device = device
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.buffers: dict[tuple[Any, ...], _Buffers] = {}
        self.pieces: dict[int, _Pieces] = {}

    @property
    def max_num_tokens(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        """Capture every bucket, largest first, all in one memory pool."""
        seconds = capture_largest_first(self.sizes, self._capture_one)
        logger.info(
            "captured piecewise CUDA graphs for steps of up to %d tokens (%d buckets) in %.1f s",
            self.max_num_tokens,
            len(self.sizes),
            seconds,
        )

    def _capture_one(self, size: int, pool: Any) -> Any:
        ids, positions = self.input_ids[:size], self.positions[:size]
        # the eager run compiles the kernels and sizes the buffers
        with splitting_at_attention(self.model, self._probe):
            self.model(ids, positions)
        torch.cuda.synchronize()
        graphs = [torch.cuda.CUDAGraph()]
        layers: list[tuple[torch.nn.Module, _Buffers]] = []

        def split(
            layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
        ) -> torch.Tensor:
            buffers = self.buffers[_signature(query, key, value)]
            rows = slice(0, len(query))
            buffers.query[rows].copy_(query)
            buffers.key[rows].copy_(key)
            buffers.value[rows].copy_(value)
            graphs[-1].capture_end()
            layers.append((layer, buffers))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=graphs[0].pool())
            return buffers.output[rows]

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=pool)
            with splitting_at_attention(self.model, split):
                hidden = self.model(ids, positions)
            graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.pieces[size] = _Pieces(graphs, layers, hidden)
        return graphs[0].pool()

    def _probe(
        self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """The eager run before a capture: make the buffers of each attention input shape (at
        the first, largest bucket); the layers' outputs are zeros."""
        signature = _signature(query, key, value)
        if signature not in self.buffers:
            rows = self.max_num_tokens

            def static(like: torch.Tensor) -> torch.Tensor:
                return torch.zeros(rows, *like.shape[1:], dtype=like.dtype, device=like.device)

            self.buffers[signature] = _Buffers(
                static(query), static(key), static(value), static(query)
            )
        return torch.zeros_like(query)

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: StepMetadata,
        carried: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of a step of T <= max_num_tokens new tokens
        (host `token_ids` and `positions` [T]) whose attention metadata is `metadata`.
        `carried` (token indices, token ids on the device) overrides those tokens' ids."""
        num_tokens = len(token_ids)
        size = next(s for s in self.sizes if s >= num_tokens)
        host = torch.zeros(2, size, dtype=torch.int64)
        host[0, :num_tokens] = token_ids
        host[1, :num_tokens] = positions
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        if carried is not None:
            self.input_ids[carried[0]] = carried[1]
        pieces = self.pieces[size]
        rows = slice(0, num_tokens)
        with set_forward_context(metadata):
            for graph, (layer, buffers) in zip(pieces.graphs, pieces.layers, strict=False):
                graph.replay()
                out = layer(buffers.query[rows], buffers.key[rows], buffers.value[rows])
                buffers.output[rows].copy_(out)
            pieces.graphs[-1].replay()
        return pieces.hidden[rows]


def _signature(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[Any, ...]:
    return tuple((t.shape[1:], t.dtype) for t in (query, key, value))
