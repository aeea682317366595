"""`SamplingParams`: how to sample one request's tokens, validated up front (vLLM's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from attnserve.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """What each streamed output holds: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0 or -1, top_p 1 and min_p 0 each disable that filter.

    `n` completions are returned, chosen from `best_of` (default n) by cumulative log-probability.
    `stop` strings end a completion and are left out of its text; `stop_token_ids`, and EOS unless
    `ignore_eos`, end it too, but not before `min_tokens`. `logprobs` / `prompt_logprobs` ask for
    that many top log-probabilities per token (plus the chosen token's). `structured_outputs`
    constrains the output to a JSON schema, regex, choice or grammar (xgrammar).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.best_of is None or self.best_of >= self.n, "best_of must be >= n"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (all(s for s in self.stop or []), "stop strings must be non-empty"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in 0..{MAX_LOGPROBS}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in 0..{MAX_LOGPROBS}",
            ),
            *_structured_checks(self),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_candidates(self) -> int:
        """How many completions are generated (best_of, or n)."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


def _structured_checks(params: SamplingParams) -> list[tuple[bool, str]]:
    spec = params.structured_outputs
    return [
        (
            spec is None or isinstance(spec, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams",
        ),
        (
            spec is None or params.min_tokens == 0,
            "min_tokens cannot be combined with structured_outputs (the grammar decides where "
            "the output may end)",
        ),
    ]
