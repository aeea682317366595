"""Which request fields the server serves, accepts without effect, or refuses — and why.

A field a request model declares is served (protocol.py). Any other field is judged here, so
that none is silently ignored: a few that common clients send are accepted where their value
asks for nothing this server would have to do (`store: false`, `service_tier: "auto"`, ...);
a field of OpenAI's API that is not implemented is refused (400) with the reason; anything
else is refused as unknown. docs/serving.md lists every field with its status. Fields that name
token ids are checked against the model's vocabulary here too (`token_ids_out_of_range`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from attnserve.entrypoints.openai.protocol import SamplingRequest


def _null(value: Any) -> bool:
    return value is None


def _anything(value: Any) -> bool:
    return True


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


@dataclass(frozen=True)
class FieldRule:
    """`accepts(value)`: the value asks for nothing (accepted, no effect); else refused, `why`."""

    accepts: Callable[[Any], bool]
    why: str


FIELD_RULES: dict[str, FieldRule] = {
    # accepted without effect (sent by common clients)
    "store": FieldRule(_one_of(False), "stored completions are not implemented"),
    "service_tier": FieldRule(_one_of("auto", "default"), "there is one service tier"),
    "modalities": FieldRule(_one_of(["text"]), "text is the only output modality"),
    "prompt_cache_key": FieldRule(_anything, "a cache hint; prefix caching is automatic here"),
    "safety_identifier": FieldRule(_anything, "an abuse-monitoring id, like user"),
    # refused: OpenAI's, not implemented
    "suffix": FieldRule(_null, "inserting text before a suffix is not implemented"),
    "audio": FieldRule(_null, "audio output is not implemented"),
    "prediction": FieldRule(_null, "predicted outputs are not implemented"),
    "web_search_options": FieldRule(_null, "web search is not implemented"),
    "metadata": FieldRule(_null, "stored completions are not implemented"),
    "reasoning_effort": FieldRule(_null, "the served models have no reasoning effort"),
    "verbosity": FieldRule(_null, "the served models have no verbosity setting"),
    "functions": FieldRule(_null, "the deprecated functions API is not implemented: use tools"),
    "function_call": FieldRule(
        _null, "the deprecated functions API is not implemented: use tool_choice"
    ),
}


def unsupported_field(
    request: BaseModel, rules: Mapping[str, FieldRule] = FIELD_RULES
) -> tuple[str, str] | None:
    """The first undeclared field of `request` that is refused by `rules` (an endpoint's own),
    with the error message; None when every field is served or accepted."""
    for name, value in (request.model_extra or {}).items():
        rule = rules.get(name)
        if rule is None:
            return name, f"unknown field {name!r}: this server does not implement it"
        if not rule.accepts(value):
            return name, f"{name!r} is not supported: {rule.why}"
    return None


def token_ids_out_of_range(request: SamplingRequest, vocab_size: int) -> tuple[str, str] | None:
    """The first field naming a token id outside the vocabulary (`stop_token_ids`, the keys of
    `logit_bias`), with the error message; None when all are in it. (A prompt's token ids are
    checked with the prompt.)"""
    fields = {"stop_token_ids": request.stop_token_ids, "logit_bias": request.logit_bias}
    for name, ids in fields.items():
        if any(not 0 <= token_id < vocab_size for token_id in ids or ()):
            return name, f"{name} token ids must be in 0..{vocab_size - 1}"
    return None
