"""What an API call's engine requests yield to its endpoint: `Delta`s (what is new in one choice),
the `Choice`s the non-streaming answers add them up to, and the helpers every endpoint renders
them with (log-probabilities JSON can carry, a position's likeliest tokens, response ids).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from attnserve.outputs import Logprob, PromptLogprobs, SampleLogprobs

LOGPROB_FLOOR = -9999.0


@dataclass
class Delta:
    """What is new in one choice (`index` counts over prompts x n) since its last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's, when asked for
    delivered: float = 0.0  # when its output reached the call (time.monotonic())


@dataclass
class Choice:
    """One choice's deltas added up (the non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs


def finite(logprob: float | None) -> float:
    """A log-probability JSON can carry: -inf, NaN or a missing one become -9999 (as vLLM)."""
    if logprob is None or not math.isfinite(logprob):
        return LOGPROB_FLOOR
    return logprob


def top_k(candidates: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The `k` likeliest of one position's entries, likeliest first."""
    best = sorted(candidates.items(), key=lambda item: -item[1].logprob)[:k]
    return [(token, entry.logprob) for token, entry in best]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
