"""`SamplingParams`: how to sample one request's tokens, validated up front (vLLM's names).

Every field is checked against its type hint first (an int is an int, not a bool or 2.5; a float
is a finite number; a bool is a bool), then against its range, each failure a ValueError naming
the field. The params travel to the engine core by pickle: plain data only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from attnserve.output_constraints import StructuredOutputsParams

MAX_LOGPROBS = 20  # the engine's default --max-logprobs (vLLM's); the engine checks its own
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100..100


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
    `ignore_eos`, end it too, but not before `min_tokens` (their tokens' text is left out too);
    `include_stop_str_in_output` keeps the stop string (or token) in the text. `logprobs` /
    `prompt_logprobs` ask for that many top log-probabilities per token (plus the chosen
    token's). `logit_bias` adds its value (-100..100) to a token's logit before sampling:
    +100 all but forces the token, -100 all but forbids it. `structured_outputs` constrains the
    output to a JSON schema, regex, choice or grammar (xgrammar); its mask applies after the bias,
    so a bias cannot let a forbidden token through.
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
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # (vLLM's; tokenizers without a fast backend)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            self._check_type(f.name)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)

    def _check_type(self, name: str) -> None:
        """ValueError unless the field's value matches its type hint; a float field given an
        int holds it as a float."""
        hint, value = _HINTS[name], getattr(self, name)
        if not _matches(value, hint):
            raise ValueError(f"{name} must be of type {_describe(hint)}, got {value!r}")
        if hint is float:
            setattr(self, name, float(value))

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
                all(t >= 0 for t in self.logit_bias or {}),
                "logit_bias token ids must be >= 0",
            ),
            (
                all(abs(b) <= MAX_LOGIT_BIAS for b in (self.logit_bias or {}).values()),
                f"logit_bias values must be in -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}",
            ),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs must be >= 0",
            ),
            (
                self.structured_outputs is None or self.min_tokens == 0,
                "min_tokens cannot be combined with structured_outputs (the grammar decides "
                "where the output may end)",
            ),
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
    def outputs_only_when_finished(self) -> bool:
        """Whether the request's completions are needed only once finished: FINAL_ONLY output
        (or best_of pruning) and no stop string to watch for token by token."""
        pruning = self.num_candidates > self.n
        return (self.output_kind is RequestOutputKind.FINAL_ONLY or pruning) and not self.stop

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


def _matches(value: Any, hint: Any) -> bool:
    """Whether `value` is of the type `hint` (unions, None, list[X], dict[K, V], classes): bools
    are not ints, ints are floats, floats are finite."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:
        return any(_matches(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(k, args[0]) and _matches(v, args[1]) for k, v in value.items()
        )
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return real and math.isfinite(value)
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    """A type hint as the message of a ValueError says it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is types.UnionType:
        return " | ".join(_describe(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_describe(a) for a in args)}]"
    if hint is float:
        return "float (finite)"
    return "None" if hint is type(None) else hint.__name__


_HINTS = typing.get_type_hints(SamplingParams)
