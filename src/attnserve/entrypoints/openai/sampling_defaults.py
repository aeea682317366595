"""The model's sampling defaults (`--generation-config`) in a request's `SamplingParams`.

A field the request sets (even to its default value) is the request's; a field it omits is
the model's generation_config.json value where that has one (`ModelConfig.
get_diff_sampling_param`), else the API's default — as vLLM applies them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from attnserve.entrypoints.openai.protocol import SamplingRequest
from attnserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


def model_sampling_defaults(config: ModelConfig) -> dict[str, Any]:
    """The model's defaults, logged (once, for all the endpoints) when there are any."""
    defaults = config.get_diff_sampling_param()
    if defaults:
        _log_once(repr(defaults))
    return defaults


@functools.cache
def _log_once(defaults: str) -> None:
    logger.info("default sampling params from the model's generation config: %s", defaults)


def sampling_fields(request: SamplingRequest, defaults: dict[str, Any]) -> dict[str, Any]:
    """DEFAULTED_FIELDS' values: the request's where it sets them, else the model's."""
    given = request.model_fields_set
    return {
        name: getattr(request, name) if name in given or name not in defaults else defaults[name]
        for name in DEFAULTED_FIELDS
    }


def max_tokens_or_default(
    request: SamplingRequest, defaults: dict[str, Any], max_tokens: int | None, room: int
) -> int | None:
    """`max_tokens` (what the request asks), or the model's default, at most `room`, where
    the request sets neither max_tokens nor max_completion_tokens."""
    if "max_tokens" not in defaults or request.model_fields_set & set(MAX_TOKENS_FIELDS):
        return max_tokens
    return min(int(defaults["max_tokens"]), room)
