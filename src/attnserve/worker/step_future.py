"""`StepFuture`: the draws of a step the model runner has launched but not waited for (the
worker's `AsyncStepOutput`).

With async scheduling the engine schedules and launches step k+1 before it reads step k's
tokens: the runner hands back a future whose tokens are being copied to pinned host memory
behind the step's kernels, and `result()` waits for that copy only when the engine needs them.
Steps whose results need more host work (log-probabilities, several draws per row, prompt
log-probabilities) are materialised at once and come back as a ready future.

`DeferredStep` is the `LaunchedForward` of ranks that take only complete plans (another process,
a step a draft model proposes in at once): nothing runs until the token bitmask is handed over,
then the whole step, its plan completed with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from attnserve.step_types import (
    AsyncStepOutput,
    SampleOutput,
    StepPlan,
    StepResults,
    TokenBitmask,
)


class StepFuture:
    def __init__(
        self,
        num_seqs: int,
        draws: tuple[list[int], torch.Tensor, torch.Tensor] | None = None,
        ready: StepResults | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Either `ready` results, or `draws`: the rows that drew, and the device tokens
        [len(rows)] they drew (one each) with those tokens' log-probabilities, whose copies to
        the host start here; `on_tokens` gets those tokens once they are read."""
        self._num_seqs = num_seqs
        self._ready = ready
        self._on_tokens = on_tokens
        self._copied: torch.cuda.Event | None = None
        self._rows: list[int] = []
        self._host: list[torch.Tensor] = []
        if draws is not None:
            self._rows, tokens, logprobs = draws
            self._host = [tokens, logprobs]
            if tokens.is_cuda:
                self._host = [_to_pinned(tokens), _to_pinned(logprobs)]
                self._copied = torch.cuda.Event()
                self._copied.record()

    def result(self) -> StepResults:
        """Each sequence's draws (None where nothing was drawn), waiting for them if need be."""
        if self._ready is None:
            if self._copied is not None:
                self._copied.synchronize()
            results: StepResults = [None] * self._num_seqs
            tokens, logprobs = (t.tolist() for t in self._host) if self._host else ([], [])
            if self._on_tokens is not None:
                self._on_tokens(tokens)
            for row, token, logprob in zip(self._rows, tokens, logprobs, strict=True):
                results[row] = SampleOutput([token], token_logprobs=[logprob])
            self._ready = results
        return self._ready


class DeferredStep:
    """A step launched whole once its token bitmask arrives: `launch` gets the plan with it."""

    def __init__(self, plan: StepPlan, launch: Callable[[StepPlan], AsyncStepOutput]) -> None:
        self._plan = plan
        self._launch = launch

    def sample(self, token_bitmask: TokenBitmask | None) -> AsyncStepOutput:
        return self._launch(dataclasses.replace(self._plan, token_bitmask=token_bitmask))


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor into pinned host memory, started behind the device's work."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
