"""`OffLoopBodyRoute`, the class of the server's routes: FastAPI's route, but a large JSON body
(`INLINE_BODY_BYTES` or more) is decoded and validated against the route's body model on the
app's `PreprocessPool` (`app.state.preprocess_pool`), not on the event loop: a 2 MiB body of
60,000 small chat messages takes ~0.2 s to decode and validate.

FastAPI's own handler then runs on a request whose body and JSON are the ones read and decoded
(FastAPI's documented custom-`Request` hook): the validated model passes its validation again at
no cost (an instance of the model), and a body that failed is reported as FastAPI reports it
(the same validation errors, or the decoding error re-raised where FastAPI would have caught
it), so the OpenAPI document and every error answer stay as they are. A smaller body, or one
that is not sent as JSON, goes to FastAPI untouched.
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from attnserve.entrypoints.openai.preprocess import PreprocessPool

INLINE_BODY_BYTES = 64 << 10  # decoded on the loop, as FastAPI does (~1 ms at worst)

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
_NOT_DECODED = object()  # a body left for FastAPI to decode


class OffLoopBodyRoute(APIRoute):
    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

        async def handle(request: Request) -> Response:
            try:
                body = await request.body()
            except Exception as error:  # reported by FastAPI's handler (413, 408, 400)
                return await handler(_ReadRequest(request, error))
            if len(body) < INLINE_BODY_BYTES or not _is_json(request.headers.get("content-type")):
                return await handler(_ReadRequest(request, body))
            pool: PreprocessPool = request.app.state.preprocess_pool
            data, value, errors = await pool.run(len(body), _decode, field, body)
            if errors:
                raise RequestValidationError(errors, body=data)
            return await handler(_ReadRequest(request, body, value))

        return handle


class _ReadRequest(Request):
    """The request, with its body already read (or the error reading it) and, for a large
    JSON body, its decoded value (or the decoding error)."""

    def __init__(
        self, request: Request, body: bytes | Exception, decoded: Any = _NOT_DECODED
    ) -> None:
        super().__init__(request.scope, request.receive)
        self._read = body
        self._decoded = decoded

    async def body(self) -> bytes:
        if isinstance(self._read, Exception):
            raise self._read
        return self._read

    async def json(self) -> Any:
        if self._decoded is _NOT_DECODED:
            self._decoded = _decoded(await self.body())
        if isinstance(self._decoded, Exception):
            raise self._decoded
        return self._decoded


def _decode(field: Any, body: bytes) -> tuple[Any, Any, list[Any]]:
    """(the JSON value, the validated body or the decoding error, the validation errors): as
    FastAPI's handler decodes and validates a JSON body (on a pool thread)."""
    data = _decoded(body)
    if isinstance(data, Exception):
        return None, data, []
    value, errors = field.validate(data, {}, loc=("body",))
    return data, value, list(errors)


def _decoded(body: bytes) -> Any:
    """The body's JSON value, or the error decoding it (re-raised where FastAPI's handler
    catches the errors of its own decoding)."""
    try:
        return json.loads(body)
    except Exception as error:
        return error


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI decodes a body of this content type as JSON (application/json or
    application/*+json)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )
