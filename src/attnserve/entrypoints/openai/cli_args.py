"""`attnserve serve`'s own flags (the engine's come from `EngineArgs.add_cli_args`); the
command's handler is in `attnserve.cli`, with the other commands'.

Importing this module imports no web framework: the server modules are loaded only when the
command runs.
"""

from __future__ import annotations

import argparse

TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")  # tool_parsers.TOOL_CALL_PARSERS' keys

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
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
        "--served-model-name", default=None, help="the name clients use (default: the model's)"
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (needs --tool-call-parser)',
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSER_NAMES,
        help="how tool calls are read from a free reply: hermes (<tool_call> blocks, Hermes / "
        "Qwen) or llama3_json (Llama 3's JSON)",
    )


def auto_tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for "auto" tool choice, None when it is off; ValueError for a flag alone."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None
