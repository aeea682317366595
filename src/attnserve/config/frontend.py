"""`FrontendArgs`: `attnserve serve`'s own flags (the engine's are `EngineArgs`), one frozen
dataclass whose fields `config.cli_args` turns into flags, and the checks of the API key they
give. The command's handler is in `attnserve.cli`, with the other commands'.

Importing this module imports no web framework: the server modules are loaded only when the
command runs. The parser names are the server's registries' keys (a test holds them equal).
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

from attnserve.config.cli_args import add_cli_args, arg, from_cli_args
from attnserve.lora.request import LoRAModulePath, parse_lora_module

TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")  # tool_parsers.TOOL_CALL_PARSERS' keys
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")  # reasoning_parsers.REASONING_PARSERS' keys
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_ENGINE_CORE_RESTARTS = 5
DEFAULT_MAX_QUEUED_REQUESTS = 4096  # above the largest bursts benchmarks send at once
DEFAULT_TOKENIZER_POOL_SIZE = 2
API_KEY_ENV = "ATTNSERVE_API_KEY"


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """A flag's parser of whole numbers from `minimum` up (`what` names them in the error)."""

    def parse(text: str) -> int:
        problem = argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        try:
            value = int(text)
        except ValueError:
            raise problem from None
        if value < minimum:
            raise problem
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_count = _int_at_least(0, "a whole number >= 0")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _lora_module(text: str) -> LoRAModulePath:
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True)
class FrontendArgs:
    """The server's settings beyond the engine (vLLM's `FrontendArgs`)."""

    host: str = arg("127.0.0.1", "address to bind (loopback default)")
    port: int = arg(8000, "port to listen on")
    api_key: str | None = arg(
        None, f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})"
    )
    api_key_file: str | None = arg(None, "read the API key from this file (its first line)")
    allow_no_api_key: bool = arg(
        False,
        "serve a non-loopback --host without an API key (refused otherwise)",
        action="store_true",
    )
    served_model_name: str | None = arg(None, "the name clients use (default: the model's)")
    lora_modules: list[LoRAModulePath] | None = arg(  # noqa: RUF009 (the default is None)
        None,
        "LoRA adapters served from start-up (with --enable-lora), each name=path or "
        '\'{"name": ..., "path": ...}\'; a request\'s model picks one by name',
        action="extend",
        nargs="+",
        type=_lora_module,
    )
    shutdown_timeout: float = arg(
        30.0,
        "on SIGTERM/SIGINT, seconds for the requests in flight to finish (new ones get 503) "
        "before the rest are ended with an error",
        type=_seconds,
    )
    request_timeout: float | None = arg(
        None,
        "end any request still running after this many seconds with a 504 (default: off)",
        type=_seconds,
    )
    request_read_timeout: float = arg(
        30.0,
        "close a connection whose request (headers and body) has not arrived whole in "
        "this many seconds",
        type=_seconds,
    )
    restart_engine_core: bool = arg(
        False,
        "when the engine core dies, start a new one and serve on (default: exit non-zero)",
        action="store_true",
    )
    max_engine_core_restarts: int = arg(
        DEFAULT_MAX_ENGINE_CORE_RESTARTS,
        "with --restart-engine-core: how many restarts in a row (each new core failing to "
        "start or dying within a minute of it; retried after growing waits) before the server "
        "gives up and exits 1",
        type=_count,
    )
    max_request_bytes: int = arg(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies get 413")
    tokenizer_pool_size: int = arg(
        DEFAULT_TOKENIZER_POOL_SIZE,
        "threads that decode large JSON bodies, render chat templates and tokenize, off "
        "the event loop (at most this many jobs at once; large ones leave one thread free)",
        type=_positive_int,
    )
    uvicorn_log_level: str = arg("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    disable_log_requests: bool = arg(
        False,
        "no per-request log lines (vLLM's flag; here: the line naming a request's user)",
        action="store_true",
    )
    enable_auto_tool_choice: bool = arg(
        False,
        'serve tool_choice "auto" (vLLM\'s switch, accepted: "auto" is always on, through '
        "the tool-call parser, else the server's own tool-call format)",
        action="store_true",
    )
    tool_call_parser: str | None = arg(
        None,
        "how tool calls are read from a free reply: hermes (<tool_call> blocks, Hermes / "
        "Qwen) or llama3_json (Llama 3's JSON); default: the one the model's chat template "
        "calls for, else the server's own format (tools in the prompt, calls constrained)",
        choices=TOOL_CALL_PARSER_NAMES,
    )
    max_queued_requests: int = arg(
        DEFAULT_MAX_QUEUED_REQUESTS,
        "generation requests admitted and still waiting for their first output; past it "
        "a request gets 503 with Retry-After",
        type=_positive_int,
    )
    max_request_prompt_tokens_in_flight: int | None = arg(
        None,
        "the prompt tokens one request's prompts (a completion's list) have in the engine "
        "at once, one prompt at least; the others wait their turn (default: half the KV cache)",
        type=_positive_int,
    )
    reasoning_parser: str | None = arg(
        None,
        "split chat replies' <think>...</think> into reasoning_content (streamed as "
        "reasoning_content deltas): qwen3 or deepseek_r1 (default: no split)",
        choices=REASONING_PARSER_NAMES,
    )
    chat_template: str | None = arg(
        None,
        "the chat template to use in place of the model's: a file, or the template itself",
    )
    trust_request_chat_template: bool = arg(
        False,
        "render a request's own chat_template (default: refused with a 400; a template "
        "is code the server runs)",
        action="store_true",
    )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_cli_args(parser, FrontendArgs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        return from_cli_args(cls, args)


def auto_tool_call_parser(args: FrontendArgs, detected: str | None) -> str | None:
    """The parser for "auto" tool choice: --tool-call-parser, else the one the model's chat
    template calls for (`detected`); None when there is none: then the server's own tool-call
    format serves every model (`generic_tools`). --enable-auto-tool-choice is vLLM's switch,
    accepted: "auto" is always on here."""
    return args.tool_call_parser or detected


def resolve_api_key(args: FrontendArgs, environ: dict[str, str]) -> str | None:
    """The key from --api-key, --api-key-file or $ATTNSERVE_API_KEY (one source only); ValueError
    for an empty key (given, but blank: the server would serve without one), an unreadable key
    file, two sources, or a non-loopback --host without a key (unless --allow-no-api-key)."""
    given = [v for v in (args.api_key, args.api_key_file) if v is not None]
    if len(given) > 1:
        raise ValueError("give the API key once: --api-key or --api-key-file")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out (no key)")
    from_env = environ.get(API_KEY_ENV) if not given else None
    if from_env is not None and not from_env.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty: give it a key, or unset it")
    key = args.api_key or from_env
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as file:
                key = file.readline().strip()
        except OSError as error:
            raise ValueError(f"--api-key-file {args.api_key_file!r}: {error.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} holds no key")
    if key is None and not is_loopback(args.host) and not args.allow_no_api_key:
        raise ValueError(
            f"--host {args.host} is reachable from other machines: give an API key (--api-key, "
            f"--api-key-file or ${API_KEY_ENV}) or pass --allow-no-api-key"
        )
    return key


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
