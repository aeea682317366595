"""`StepFuture`: the draws of a step the model runner has launched but not waited for (the
worker's `AsyncStepOutput`).

With async scheduling the engine schedules and launches step k+1 before it reads step k's
tokens: the runner hands back a future whose tokens are being copied to pinned host memory
behind the step's kernels, and `result()` waits for that copy only when the engine needs them.
Steps whose results need more host work (log-probabilities, several draws per row, prompt
log-probabilities) are materialised at once and come back as a ready future.
"""

from __future__ import annotations

import torch

from attnserve.core import SampleOutput, StepResults


class StepFuture:
    def __init__(
        self,
        num_seqs: int,
        rows: list[int] | None = None,
        tokens: torch.Tensor | None = None,
        ready: StepResults | None = None,
    ) -> None:
        """Either `ready` results, or the device `tokens` [len(rows)] drawn for `rows` (one
        draw each), whose copy to the host starts here."""
        self._num_seqs = num_seqs
        self._rows = rows or []
        self._ready = ready
        self._copied: torch.cuda.Event | None = None
        self._host_tokens = tokens
        if tokens is not None and tokens.is_cuda:
            self._host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host_tokens.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> StepResults:
        """Each sequence's draws (None where nothing was drawn), waiting for them if need be."""
        if self._ready is None:
            if self._copied is not None:
                self._copied.synchronize()
            results: StepResults = [None] * self._num_seqs
            tokens = [] if self._host_tokens is None else self._host_tokens.tolist()
            for row, token in zip(self._rows, tokens, strict=True):
                results[row] = SampleOutput([token])
            self._ready = results
        return self._ready
