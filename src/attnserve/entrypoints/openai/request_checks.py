"""`RequestChecks`: what every endpoint checks and builds before a request reaches the engine:
the model name and the fields it refuses, the prompt (tokenized here, so one longer than the
context is refused with a 400), and the request's `SamplingParams` (400 for a `max_tokens` that
does not fit after the prompt, token ids out of the vocabulary, or a constraint given twice).

A text too long for the context however it is tokenized is refused before it is tokenized
(`check_length`, from `prompt_bound`).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.entrypoints.openai.deltas import new_id
from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.prompt_bound import prompt_bound
from attnserve.entrypoints.openai.protocol import SamplingRequest
from attnserve.entrypoints.openai.request_fields import token_ids_out_of_range, unsupported_field
from attnserve.entrypoints.openai.sampling_defaults import (
    max_tokens_or_default,
    model_sampling_defaults,
    sampling_fields,
)
from attnserve.entrypoints.openai.serving_models import OpenAIServingModels
from attnserve.entrypoints.openai.structured import structured_outputs
from attnserve.entrypoints.openai.vllm_fields import check_vllm_fields, response_id
from attnserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class RequestChecks:
    """One model's limits and the checks of its requests against them."""

    log_requests = True  # per-request log lines (off: --disable-log-requests)

    def __init__(self, engine: AsyncLLMEngine, models: OpenAIServingModels) -> None:
        """`models`: the server's (the base model and its LoRA adapters)."""
        self.engine = engine
        self.models = models
        self.model_name = models.base_model
        config = engine.engine.model_config
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        self.prompt_bound = prompt_bound(self.tokenizer)
        self.max_logprobs = engine.engine.processor.max_logprobs  # --max-logprobs
        self.scheduling_policy = engine.engine.config.scheduler_config.scheduling_policy
        self.default_sampling = model_sampling_defaults(config)  # --generation-config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, request: BaseModel) -> None:
        """404 for another model's name (a request's `model`); 400 for a field it refuses."""
        self.models.check(getattr(request, "model", None))  # the base model or an adapter
        refused = unsupported_field(request)
        if refused is not None:
            raise ApiError(400, refused[1], refused[0], "unsupported_parameter")

    def accept(self, request: SamplingRequest, prefix: str) -> str:
        """The request's response id (`prefix-...`, see `response_id`) once the request passed
        `check_model` and `check_vllm_fields`; 400 for stream options without a stream. Logs
        the `user` it names."""
        request_id = response_id(prefix, request, new_id(prefix))
        self.check_model(request)
        check_vllm_fields(request, self.max_model_len, self.max_logprobs, self.scheduling_policy)
        options = request.stream_options
        if options is not None and not request.stream:
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        if options is not None and options.continuous_usage_stats and not options.include_usage:
            message = "continuous_usage_stats needs include_usage: true"
            raise ApiError(400, message, "stream_options.continuous_usage_stats")
        if request.user is not None and self.log_requests:
            logger.info("%s for user %r", request_id, request.user)
        return request_id

    def check_length(self, text: str, param: str) -> None:
        """400 (without tokenizing it) for a text too long for the context however the
        tokenizer splits it (see `prompt_bound`)."""
        bound = self.prompt_bound
        if bound is None or not bound.cannot_fit(text, self.max_model_len - 1):
            return
        raise ApiError(
            400,
            f"the prompt has {len(text)} characters, more than {self.max_model_len - 1} tokens "
            f"of this model can hold (one stands for {bound.chars_per_token} characters at "
            f"most); this model's maximum context length is {self.max_model_len} tokens, which "
            "must leave room for one generated token",
            param,
            "context_length_exceeded",
        )

    def encode(self, text: str, param: str, truncating: bool = False) -> list[int]:
        """The text's token ids (a text that cannot fit the context is refused first, unless
        `truncating`: the caller keeps only its last tokens)."""
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids", param)
        if not truncating:
            self.check_length(text, param)
        ids: list[int] = self.tokenizer.encode(text)
        return ids

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which must leave room for one generated token",
                param,
                "context_length_exceeded",
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ApiError(400, f"token ids must be in 0..{self.vocab_size - 1}", param)

    def sampling_params(
        self,
        request: SamplingRequest,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
        tool_constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams` (400 for what they refuse); `max_tokens` None: the
        rest of the context; `tool_constraint`: the output's, from its tool_choice."""
        room = self.max_model_len - prompt_len
        max_tokens = max_tokens_or_default(request, self.default_sampling, max_tokens, room)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens: the prompt "
                f"has {prompt_len} and max_tokens asks for {max_tokens}",
                "max_tokens",
                "context_length_exceeded",
            )
        out_of_range = token_ids_out_of_range(request, self.vocab_size)
        if out_of_range is not None:
            raise ApiError(400, out_of_range[1], out_of_range[0])
        constraint = structured_outputs(request)
        if constraint is not None and tool_constraint is not None:
            message = "tool_choice constrains the output already: no response_format with it"
            raise ApiError(400, message, "tool_choice")
        try:
            return SamplingParams(
                n=request.n,
                best_of=best_of,
                **sampling_fields(request, self.default_sampling),
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                logit_bias=request.logit_bias,
                seed=request.seed,
                max_tokens=room if max_tokens is None else max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids or [],
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=constraint or tool_constraint,
            )
        except ValueError as error:
            raise ApiError(400, str(error)) from error

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text: str = self.tokenizer.decode([token_id])
        return text
