"""vLLM's request extras both endpoints serve, beside the sampling fields: their up-front checks
(`check_vllm_fields`: 400 naming the field), `truncate_prompt_tokens` (the prompt's last k
tokens), `prompt_logprobs` as vLLM returns them (`prompt_logprobs_json`), the response id a
`request_id` gives (`response_id`) and `return_tokens_as_token_ids`' token names (`shown_token`)."""

from __future__ import annotations

from collections.abc import Callable

from attnserve.entrypoints.openai.deltas import finite
from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol import (
    PromptLogprob,
    PromptLogprobsJson,
    SamplingRequest,
)
from attnserve.outputs import PromptLogprobs

LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")  # the counts a request asks


def check_vllm_fields(
    request: SamplingRequest, max_model_len: int, max_logprobs: int, scheduling_policy: str
) -> None:
    """400 for a truncation outside 1..max_model_len, more log-probabilities than
    --max-logprobs, prompt log-probabilities with a stream, or a priority under "fcfs"."""
    k = request.truncate_prompt_tokens
    if k is not None and not 1 <= k <= max_model_len:
        message = f"truncate_prompt_tokens must be in 1..{max_model_len} (max_model_len), got {k}"
        raise ApiError(400, message, "truncate_prompt_tokens")
    for name in LOGPROB_FIELDS:
        asked = getattr(request, name, None)
        if type(asked) is int and 0 <= max_logprobs < asked:
            message = f"Requested {name} of {asked}, which is greater than max allowed: "
            raise ApiError(400, f"{message}{max_logprobs} (--max-logprobs)", name)
    if request.prompt_logprobs is not None and request.stream:
        message = "prompt_logprobs are not available when stream is enabled"
        raise ApiError(400, message, "prompt_logprobs")
    if request.priority != 0 and scheduling_policy != "priority":
        message = "priority needs a server started with --scheduling-policy priority"
        raise ApiError(400, message, "priority")


def truncated(token_ids: list[int], request: SamplingRequest) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (all of them without it)."""
    k = request.truncate_prompt_tokens
    return token_ids if k is None else token_ids[-k:]


def response_id(prefix: str, request: SamplingRequest, random_id: str) -> str:
    """`prefix-<request_id>` (vLLM's), else the random id."""
    return random_id if request.request_id is None else f"{prefix}-{request.request_id}"


def shown_token(token_id: int, text: str, as_ids: bool) -> str:
    """A logprob entry's token: its text, or with `return_tokens_as_token_ids` "token_id:N"."""
    return f"token_id:{token_id}" if as_ids else text


def prompt_logprobs_json(
    entries: PromptLogprobs | None, token_text: Callable[[int], str]
) -> PromptLogprobsJson | None:
    """The prompt's log-probabilities as vLLM returns them: None for the first token, then per
    token {token id: {logprob, rank, decoded_token}} (-inf as -9999)."""
    if entries is None:
        return None
    return [
        None
        if row is None
        else {
            token_id: PromptLogprob(
                logprob=finite(entry.logprob),
                rank=entry.rank,
                decoded_token=entry.decoded_token or token_text(token_id),
            )
            for token_id, entry in row.items()
        }
        for row in entries
    ]
