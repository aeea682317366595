"""`attnserve serve`'s own flags (the engine's come from `EngineArgs.add_cli_args`); the
command's handler is in `attnserve.cli`, with the other commands'.

Importing this module imports no web framework: the server modules are loaded only when the
command runs.
"""

from __future__ import annotations

import argparse

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
