"""`POST /tokenize` and `POST /detokenize`, vLLM's routes beside the OpenAI API: a prompt, or a
conversation rendered as `/v1/chat/completions` renders it (`render_messages`), as token ids
(with their count, the model's `max_model_len` and, if asked, each token's string); token ids back
to text. Only the tokenizer is used, never the engine, on the preprocessing pool (off the event
loop); a prompt longer than the context is counted, not refused (as vLLM: the client compares
`count` with `max_model_len`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from attnserve.entrypoints.openai.chat_template import template_options
from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from attnserve.entrypoints.openai.serving_chat import render_messages
from attnserve.entrypoints.openai.serving_engine import OpenAIServing

R = TypeVar("R", bound=BaseModel)


class OpenAIServingTokenization(OpenAIServing):
    trust_request_chat_template = False  # --trust-request-chat-template

    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest, raw: Request
    ) -> Response:
        """A `TokenizeResponse`, as JSON rendered off the loop (hundreds of thousands of ids)."""
        self.check_model(request)
        return await self.off_loop(raw, _rendered, self._tokenize, request)

    async def create_detokenize(self, request: DetokenizeRequest, raw: Request) -> Response:
        """A `DetokenizeResponse`, as JSON rendered off the loop."""
        self.check_model(request)
        return await self.off_loop(raw, _rendered, self._detokenize, request)

    def _tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        if isinstance(request, TokenizeChatRequest):
            tokenizer = self._tokenizer("/tokenize", "messages")
            ids = self._tokenize_chat(tokenizer, request)
        else:
            tokenizer = self._tokenizer("/tokenize", "prompt")
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        token_strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs
        )

    def _detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer = self._tokenizer("/detokenize", "tokens")
        for i, token_id in enumerate(request.tokens):
            if token_id >= self.vocab_size:
                message = f"token ids must be in 0..{self.vocab_size - 1}"
                raise ApiError(400, message, f"tokens.{i}")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    def _tokenizer(self, route: str, param: str) -> Any:
        """The model's tokenizer; 400 naming `param` when it has none (dummy weights)."""
        if self.tokenizer is None:
            message = f"this model has no tokenizer (dummy weights): {route} needs one"
            raise ApiError(400, message, param)
        return self.tokenizer

    def _tokenize_chat(self, tokenizer: Any, request: TokenizeChatRequest) -> list[int]:
        last_role = request.messages[-1].role if request.messages else None
        options = template_options(request, last_role, self.trust_request_chat_template)
        tools = None
        if request.tools is not None:  # as /v1/chat/completions passes them (tool_plan)
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        text = render_messages(tokenizer, request.messages, tools, options)
        ids: list[int] = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return ids


def _rendered(build: Callable[[R], BaseModel], request: R) -> Response:
    """`build(request)` as a JSON response (what FastAPI would render of it)."""
    return Response(build(request).model_dump_json(), media_type="application/json")
