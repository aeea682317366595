"""The OpenAI-compatible HTTP server: `build_app` (the FastAPI app over an `AsyncLLMEngine`) and
`run_server` (`attnserve serve`: load the engine, then serve it with uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses` (JSON, or
server-sent events with `stream: true`), `GET /v1/models` and `GET /v1/models/{id}`, vLLM's
`POST /tokenize` and `POST /detokenize`, `GET /health` (503 while the warm-up runs, while
draining and once the engine has failed; vLLM's `/ping`, GET or POST, answers the same),
`GET /version` and `GET /metrics` (Prometheus text). Errors are
OpenAI-style objects (see `errors`).

The engine core runs in a process of its own by default (`--engine-core-process`); this process
does HTTP, JSON, tokenizing, detokenizing, stop strings and SSE. On start-up the app warms the
engine (`engine.warmup`) in the background; `/health` answers 200 only after that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from attnserve.config.engine_args import EngineArgs
from attnserve.config.frontend import (
    FrontendArgs,
    auto_tool_call_parser,
    is_loopback,
    resolve_api_key,
)
from attnserve.engine.async_llm_engine import AsyncLLMEngine
from attnserve.engine.startup_gc import freeze_startup_objects
from attnserve.engine.warmup import warm_up
from attnserve.entrypoints.openai.admission import Admission
from attnserve.entrypoints.openai.body_parsing import OffLoopBodyRoute
from attnserve.entrypoints.openai.chat_template import use_chat_template
from attnserve.entrypoints.openai.errors import (
    ApiError,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    error_response,
    install_error_handlers,
)
from attnserve.entrypoints.openai.lifecycle import (
    ANSWERS_OUT_S,
    BodyDeadlineMiddleware,
    DrainingServer,
    InFlightMiddleware,
    ServerLifecycle,
    server_protocol,
)
from attnserve.entrypoints.openai.metrics import ServerMetrics
from attnserve.entrypoints.openai.preprocess import PreprocessPool
from attnserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    VersionResponse,
)
from attnserve.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest
from attnserve.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from attnserve.entrypoints.openai.reasoning_parsers import reasoning_parser
from attnserve.entrypoints.openai.replies import ClientDisconnected
from attnserve.entrypoints.openai.serving_chat import OpenAIServingChat
from attnserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from attnserve.entrypoints.openai.serving_models import OpenAIServingModels, add_lora_routes
from attnserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from attnserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from attnserve.entrypoints.openai.tool_parsers import parser_for_chat_template
from attnserve.version import __version__

logger = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (
            400,
            "bad request: not JSON, invalid UTF-8, not the schema, a refused field, or past "
            "the model's limits",
        ),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (503, "the engine has failed (or, on /health, is still warming up)"),
    ]
}
_SSE_EVENT = {  # each server-sent event, as decoded from the stream
    "type": "object",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE] last"}},
    "required": ["data"],
}
_STREAM: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the response, or with stream: true its chunks as server-sent events",
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    }
}


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    options: FrontendArgs | None = None,
    warm: bool = True,
) -> tuple[FastAPI, ServerLifecycle]:
    """The app and its lifecycle (`lifecycle`: drain, engine watch). Its start-up (lifespan)
    warms the engine, with `warm`, before /health says 200, and watches the engine core; its
    shutdown (after the drain, or once uvicorn has cut the connections) shuts the engine down,
    so the engine core is stopped before the process exits. `options`: the server's flags,
    with the API key and tool-call parser resolved (`run_server`)."""
    options = options or FrontendArgs()
    metrics = ServerMetrics(
        engine.latest_stats, lambda: not engine.errored, lambda: engine.engine.step_stats
    )
    lifecycle = ServerLifecycle(
        engine,
        metrics,
        options.shutdown_timeout,
        options.restart_engine_core,
        options.max_engine_core_restarts,
    )
    pool = PreprocessPool(options.tokenizer_pool_size)
    models = _serving_models(engine, model_name, options, metrics)
    completion = OpenAIServingCompletion(engine, models, metrics, pool)
    chat = OpenAIServingChat(engine, models, metrics, pool, options.tool_call_parser)
    completion.request_timeout_s = chat.request_timeout_s = options.request_timeout
    completion.admission = chat.admission = _admission(engine, options, metrics)
    tokenization = OpenAIServingTokenization(engine, models, metrics, pool)
    _set_chat_template_options(options, chat, tokenization)
    completion.log_requests = chat.log_requests = not options.disable_log_requests
    ready = asyncio.Event()
    if not warm:
        ready.set()

    async def warm_then_ready() -> None:
        try:
            await warm_up(engine)
        except Exception:  # the engine failed: /health says so
            logger.exception("the warm-up failed")
            return
        ready.set()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(lifecycle.watch_engine())]
        if warm:
            tasks.append(asyncio.create_task(warm_then_ready()))
        yield
        for task in tasks:
            task.cancel()
        pool.shutdown()
        await asyncio.to_thread(engine.shutdown)

    app = _App(
        title="attnserve", version=__version__, summary="OpenAI-compatible API", lifespan=lifespan
    )
    app.state.preprocess_pool = pool
    app.router.route_class = OffLoopBodyRoute  # large JSON bodies decoded on the pool
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnected, _on_disconnect)

    @app.get("/health", response_model=HealthResponse, responses={503: _ERRORS[503]})
    async def health() -> HealthResponse:
        if engine.errored:
            raise ApiError(503, lifecycle.engine_failure())
        if lifecycle.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if not ready.is_set():
            raise ApiError(503, "the engine is warming up", code="warming_up")
        return HealthResponse()

    @app.api_route("/ping", methods=["GET", "POST"], response_model=HealthResponse)
    async def ping() -> HealthResponse:
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        text = metrics.render()  # from the gauges the core last pushed: no step is waited for
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get(  # the base model's card has no root or parent (only an adapter's)
        "/v1/models",
        response_model=ModelList,
        response_model_exclude_none=True,
        responses={401: _ERRORS[401]},
    )
    async def list_models() -> ModelList:
        return ModelList(data=models.cards())

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=ModelCard,
        response_model_exclude_none=True,
        responses={401: _ERRORS[401], 404: _ERRORS[404]},
    )
    async def model(model_id: str) -> ModelCard:
        return models.card(model_id)

    if models.checker is not None:
        add_lora_routes(app, models)

    @app.post(
        "/v1/completions", response_model=CompletionResponse, responses={**_STREAM, **_ERRORS}
    )
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await completion.create_completion(body, raw)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_STREAM, **_ERRORS},
    )
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await chat.create_chat_completion(body, raw)

    responses = OpenAIServingResponses(chat)

    @app.post("/v1/responses", response_model=ResponseObject, responses={**_STREAM, **_ERRORS})
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return await responses.create_response(body, raw)

    no_engine_errors: dict[int | str, dict[str, Any]] = {
        status: _ERRORS[status] for status in (400, 401, 404, 413)
    }

    @app.post("/tokenize", response_model=TokenizeResponse, responses=no_engine_errors)
    async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
        return await tokenization.create_tokenize(body, raw)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=no_engine_errors)
    async def detokenize(body: DetokenizeRequest, raw: Request) -> Response:
        return await tokenization.create_detokenize(body, raw)

    # the last added runs first: key, in-flight count, body size limit, then the body's deadline
    app.add_middleware(BodyDeadlineMiddleware, timeout_s=options.request_read_timeout)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_bytes)
    app.add_middleware(InFlightMiddleware, lifecycle=lifecycle)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    return app, lifecycle


def _set_chat_template_options(
    options: FrontendArgs, chat: OpenAIServingChat, tokenization: OpenAIServingTokenization
) -> None:
    """--reasoning-parser and --trust-request-chat-template on the endpoints that use them."""
    if options.reasoning_parser is not None:
        chat.reasoning_parser = reasoning_parser(options.reasoning_parser)
    trusted = options.trust_request_chat_template
    chat.trust_request_chat_template = tokenization.trust_request_chat_template = trusted


def _serving_models(
    engine: AsyncLLMEngine, model_name: str, options: FrontendArgs, metrics: ServerMetrics
) -> OpenAIServingModels:
    """The base model and, with LoRA on, the adapters of --lora-modules (checked now)."""
    processor = engine.engine.processor
    checker = processor.lora_checker if engine.engine.config.lora_config is not None else None
    max_model_len = engine.engine.model_config.max_model_len
    return OpenAIServingModels(
        model_name, max_model_len, checker, tuple(options.lora_modules or ()), metrics.registry
    )


def _admission(engine: AsyncLLMEngine, options: FrontendArgs, metrics: ServerMetrics) -> Admission:
    prompt_tokens = options.max_request_prompt_tokens_in_flight
    admission = Admission(
        options.max_queued_requests,
        prompt_tokens or engine.engine.processor.kv_cache_tokens // 2,
        metrics.rejected.labels("queue_full").inc,
    )
    metrics.queued.set_function(lambda: admission.num_queued)
    return admission


class _App(FastAPI):
    """FastAPI, whose OpenAPI document does not promise the 422 it never sends (a body that
    does not match the schema is a 400 here, as in OpenAI's API)."""

    def openapi(self) -> dict[str, Any]:
        schema = super().openapi()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    logger.info("client went away: %s aborted", request.url.path)
    return error_response(ApiError(499, "client closed the request"))


def served_model_name(args: EngineArgs) -> str:
    """The name clients pass as `model`: the model argument, or the embedded model's name."""
    if args.model is not None:
        return args.model
    from attnserve.model.default_model import embedded_gguf_path

    return embedded_gguf_path().stem.split(".")[0]


def run_server(args: argparse.Namespace) -> int:
    """`attnserve serve`: 0 after a drain; 1 when the engine core died (without
    --restart-engine-core, or past --max-engine-core-restarts); 128 + the signal's number after
    a second SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args).with_server_defaults()
    frontend = FrontendArgs.from_cli_args(args)
    api_key = resolve_api_key(frontend, dict(os.environ))
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        use_chat_template(engine.tokenizer, frontend.chat_template)
        template = getattr(engine.tokenizer, "chat_template", None)
        tool_call_parser = auto_tool_call_parser(frontend, parser_for_chat_template(template))
    except ValueError:
        engine.shutdown()
        raise
    if tool_call_parser is not None:
        logger.info('"auto" tool choice on: replies read by the %s parser', tool_call_parser)
    else:
        logger.info("tools in the server's own format: listed in the prompt, calls constrained")
    options = dataclasses.replace(frontend, api_key=api_key, tool_call_parser=tool_call_parser)
    if options.api_key is None and not is_loopback(options.host):
        logger.warning("serving on %s without an API key (--allow-no-api-key)", options.host)
    name = options.served_model_name or served_model_name(engine_args)
    app, lifecycle = build_app(engine, name, options)
    freeze_startup_objects()  # the modules and engine state built so far stay
    logger.info("serving %r on http://%s:%d", name, options.host, options.port)
    protocol = server_protocol(options.request_read_timeout)
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.uvicorn_log_level,
        http=protocol,
        timeout_graceful_shutdown=int(ANSWERS_OUT_S),
    )
    try:
        DrainingServer(config, lifecycle).run()
    finally:
        engine.shutdown()
    return lifecycle.exit_code
