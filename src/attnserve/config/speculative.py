"""`SpeculativeConfig`: speculative decoding (vLLM's `speculative_config`), read from its dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model")
NGRAM_FIELDS = ("prompt_lookup_max", "prompt_lookup_min")
DEFAULT_PROMPT_LOOKUP = 5
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): before each step of a small batch,
    up to num_speculative_tokens draft tokens per decoding sequence, verified in one forward
    pass. method "ngram" drafts by prompt lookup: the tokens that followed an earlier
    occurrence of the sequence's last prompt_lookup_max..prompt_lookup_min tokens (each
    defaults to the other, both to 5); method "draft_model" drafts with `model` (a smaller
    model of the same vocabulary, greedily, with a KV cache of its own). Speculation steps
    aside while more than disable_by_batch_size sequences run (a large batch is compute-bound:
    drafts would cost more than they save; those steps also keep async scheduling, which
    speculation turns off)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model of method "draft_model"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            _check_speculative_int(name, getattr(self, name))
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model: method 'draft_model' needs a draft model, and only it "
                f"takes one (method {self.method!r}, model {self.model!r})"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """The config of a `speculative_config` dict (as vLLM takes it); every key must be one
        this engine serves."""
        if not isinstance(values, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        given = dict(values)
        if "model" in given:  # vLLM's rule: a draft model's method is "draft_model"
            given.setdefault("method", "draft_model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}"
            )
        if "num_speculative_tokens" not in given:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if given.get("method") == "draft_model":
            for name in NGRAM_FIELDS:
                if name in given:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram' only")
        lookup_max, lookup_min = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if value is not None:  # checked before one stands in for the other
                _check_speculative_int(name, value)
        if lookup_max is None:
            lookup_max = DEFAULT_PROMPT_LOOKUP if lookup_min is None else lookup_min
        given["prompt_lookup_max"] = lookup_max
        given["prompt_lookup_min"] = lookup_max if lookup_min is None else lookup_min
        return cls(**given)


def _check_speculative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
