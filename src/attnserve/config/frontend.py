"""`attnserve serve`'s own flags (the engine's come from `EngineArgs.add_cli_args`); the
command's handler is in `attnserve.cli`, with the other commands'.

Importing this module imports no web framework: the server modules are loaded only when the
command runs.
"""

from __future__ import annotations

import argparse
import ipaddress

from attnserve.entrypoints.openai.preprocess import DEFAULT_THREADS as PREPROCESS_THREADS
from attnserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")  # tool_parsers.TOOL_CALL_PARSERS' keys

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_MAX_ENGINE_CORE_RESTARTS = 5
DEFAULT_MAX_QUEUED_REQUESTS = 4096  # above the largest bursts benchmarks send at once
API_KEY_ENV = "ATTNSERVE_API_KEY"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback default)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--api-key-file", default=None, help="read the API key from this file (its first line)"
    )
    parser.add_argument(
        "--allow-no-api-key",
        action="store_true",
        help="serve a non-loopback --host without an API key (refused otherwise)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients use (default: the model's)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds for the requests in flight to finish (new ones get 503) "
        "before the rest are ended with an error",
    )
    parser.add_argument(
        "--request-timeout",
        type=_seconds,
        default=None,
        help="end any request still running after this many seconds with a 504 (default: off)",
    )
    parser.add_argument(
        "--request-read-timeout",
        type=_seconds,
        default=30.0,
        help="close a connection whose request (headers and body) has not arrived whole in "
        "this many seconds",
    )
    parser.add_argument(
        "--restart-engine-core",
        action="store_true",
        help="when the engine core dies, start a new one and serve on (default: exit non-zero)",
    )
    parser.add_argument(
        "--max-engine-core-restarts",
        type=_count,
        default=DEFAULT_MAX_ENGINE_CORE_RESTARTS,
        help="with --restart-engine-core: how many restarts in a row (each new core failing to "
        "start or dying within a minute of it; retried after growing waits) before the server "
        "gives up and exits 1",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--tokenizer-pool-size",
        type=_positive_int,
        default=PREPROCESS_THREADS,
        help="threads that decode large JSON bodies, render chat templates and tokenize, off "
        "the event loop (at most this many jobs at once; large ones leave one thread free)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no per-request log lines (vLLM's flag; here: the line naming a request's user)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (vLLM\'s switch, accepted: "auto" is always on, through '
        "the tool-call parser, else the server's own tool-call format)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSER_NAMES,
        help="how tool calls are read from a free reply: hermes (<tool_call> blocks, Hermes / "
        "Qwen) or llama3_json (Llama 3's JSON); default: the one the model's chat template "
        "calls for, else the server's own format (tools in the prompt, calls constrained)",
    )
    _add_admission_args(parser)
    _add_chat_template_args(parser)


def _add_chat_template_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split chat replies' <think>...</think> into reasoning_content (streamed as "
        "reasoning_content deltas): qwen3 or deepseek_r1 (default: no split)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to use in place of the model's: a file, or the template itself",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (default: refused with a 400; a template "
        "is code the server runs)",
    )


def _add_admission_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="generation requests admitted and still waiting for their first output; past it "
        "a request gets 503 with Retry-After",
    )
    parser.add_argument(
        "--max-request-prompt-tokens-in-flight",
        type=_positive_int,
        default=None,
        help="the prompt tokens one request's prompts (a completion's list) have in the engine "
        "at once, one prompt at least; the others wait their turn (default: half the KV cache)",
    )


def auto_tool_call_parser(args: argparse.Namespace, detected: str | None) -> str | None:
    """The parser for "auto" tool choice: --tool-call-parser, else the one the model's chat
    template calls for (`detected`); None when there is none: then the server's own tool-call
    format serves every model (`generic_tools`). --enable-auto-tool-choice is vLLM's switch,
    accepted: "auto" is always on here."""
    return args.tool_call_parser or detected


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return value


def resolve_api_key(args: argparse.Namespace, environ: dict[str, str]) -> str | None:
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
