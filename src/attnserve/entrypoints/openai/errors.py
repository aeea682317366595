"""Every failure as an OpenAI-style error object `{"error": {message, type, param, code}}`.

`ApiError` is what the serving layer raises; the handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors (400, as OpenAI answers: a body that is not JSON, or one of
the wrong shape, its first offending field as `param`), HTTP errors and anything unexpected
(500) into that object, and log each one. Two pure
ASGI middlewares run before any route: a request-body size limit (413) and the API key (401).
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnserve.entrypoints.openai.json_body import TOO_DEEP
from attnserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}  # e.g. Retry-After on a 503, Allow on a 405


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    """The JSON text of an error object (for responses and for an error event mid-stream)."""
    info = ErrorInfo(
        message=message, type=_ERROR_TYPES.get(status, "server_error"), param=param, code=code
    )
    return ErrorResponse(error=info).model_dump_json()


EXPECTED_CODES = ("warming_up", "shutting_down")  # 503s that are part of normal operation


def error_response(error: ApiError, request: Request | None = None) -> JSONResponse:
    """The error as a JSON response, logged (with the method and path of `request`)."""
    if error.code in EXPECTED_CODES:
        log = logger.info
    else:
        log = logger.warning if error.status < 500 else logger.error
    where = "" if request is None else f" ({request.method} {request.url.path})"
    log("%d %s%s", error.status, error.message, where)
    body = error_body(error.status, error.message, error.param, error.code)
    return JSONResponse(json.loads(body), status_code=error.status, headers=error.headers)


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """A short message (never echoing the input) and the first offending field."""
    parts: list[str] = []
    param = None
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if _is_field(p))
        param = param or loc or None
        part = f"{loc or 'body'}: {e.get('msg', 'invalid')}"
        if part not in parts:
            parts.append(part)
    return "; ".join(parts[:5]), param


def _is_field(part: object) -> bool:
    """A field name, list index or dict key (a token id) in an error's location (not "body",
    not a union member)."""
    return isinstance(part, int) or (
        isinstance(part, str) and (part.isidentifier() or part.isdigit()) and part != "body"
    )


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    message, param = _describe(list(errors))
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(ApiError(400, f"the body is not valid JSON ({message})"), request)
    return error_response(ApiError(400, message, param), request)


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, ApiError):
        raise exc
    return error_response(exc, request)


_UNPARSED_BODY = "There was an error parsing the body"  # FastAPI's, for a body it could not read


def _unread_body(cause: BaseException | None) -> str:
    """Why FastAPI could not read a body, from the exception it caught."""
    if isinstance(cause, UnicodeDecodeError):
        return "the body could not be read as text: a JSON body must be UTF-8"
    if isinstance(cause, RecursionError):  # the parser's own limit (json_body's comes first)
        return TOO_DEEP
    return f"the body could not be read ({type(cause).__name__})"


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """An HTTP error as an error object, with its headers (`Allow` on a 405)."""
    if not isinstance(exc, HTTPException):
        raise exc
    message = str(exc.detail)
    if exc.status_code == 400 and message == _UNPARSED_BODY:
        message = _unread_body(exc.__cause__)
    error = ApiError(exc.status_code, message, headers=dict(exc.headers or {}))
    return error_response(error, request)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}"), request)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)


async def send_error(
    send: Send, error: ApiError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    response = error_response(error)
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [*response.raw_headers, *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": response.body})


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`, by its Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ApiError(413, f"the request body is over {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            await send_error(send, too_large if length.isdigit() else ApiError(400, "bad length"))
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, too_large.message)
            return message

        await self.app(scope, limited_receive, send)


KEYED_PATHS = ("/tokenize", "/detokenize")  # beside /v1 (vLLM leaves these two open)


class ApiKeyMiddleware:
    """Every /v1 route, and `KEYED_PATHS`, needs `Authorization: Bearer <api_key>` (the scheme in
    any case, as HTTP has it); 401 with `WWW-Authenticate: Bearer` otherwise."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS
        ):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self.expected):
                challenge = [(b"www-authenticate", b"Bearer")]
                await send_error(send, ApiError(401, "a valid API key is required"), challenge)
                return
        await self.app(scope, receive, send)
