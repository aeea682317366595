"""A bound on how deep a request's JSON body nests: a body whose arrays and objects nest deeper
than MAX_JSON_DEPTH (`too_deep`) is answered with a 400 saying so (TOO_DEEP) before any route
parses it (`lifecycle.BodyDeadlineMiddleware`, which reads every body whole). Python's parser
alone gives up a little short of 1,000 levels, by how deep the interpreter's stack already is,
and FastAPI reports that RecursionError as a body it could not read (`errors` names it too deep
as well, should it happen).

The depth is measured only for a body with more than MAX_JSON_DEPTH brackets, on its bytes with
the strings taken out: a running sum of +1 per `[` or `{` and -1 per `]` or `}`, in numpy
(some 15 ms a MiB on the CPU, beside the parse's own 10).
"""

from __future__ import annotations

import json
import re

import numpy as np

MAX_JSON_DEPTH = 512
TOO_DEEP = (
    f"the JSON body is nested too deeply: arrays and objects may nest at most {MAX_JSON_DEPTH} "
    "levels"
)

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # one JSON string
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar; for text that is
    not JSON, as deep as its brackets outside strings go)."""
    try:
        encoding = json.detect_encoding(body)  # what json.loads reads bytes as
        text = body if encoding == "utf-8" else body.decode(encoding).encode()
    except UnicodeDecodeError:
        text = body
    structure = np.frombuffer(_STRING.sub(b"", text), np.uint8)
    if not structure.size:
        return 0
    return max(int(np.cumsum(_STEP[structure], dtype=np.int64).max()), 0)


def too_deep(body: bytes) -> bool:
    """Whether `body` nests deeper than MAX_JSON_DEPTH (its depth measured only when it has
    more brackets than that)."""
    brackets = body.count(b"[") + body.count(b"{")
    return brackets > MAX_JSON_DEPTH and json_depth(body) > MAX_JSON_DEPTH
