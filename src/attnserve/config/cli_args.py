"""How `EngineArgs.add_cli_args` parses a flag: the model given once (as MODEL or `--model`),
a dict field as a JSON object, any other field as its plain or optional type."""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable
from typing import Any


class ModelOnce(argparse.Action):
    """Stores the model, given as MODEL or as --model; an error if given twice, differently."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"the model is given twice: {given!r} and {values!r}")
        setattr(namespace, self.dest, values)


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def cli_type(hint: Any) -> Callable[[str], Any]:
    """What a flag's text parses to: the field's type, or T for an optional `T | None`; a
    dict field takes a JSON object."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [t for t in options if t is not type(None)]
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is dict:
        return _json_object
    if len(kinds) != 1 or not isinstance(kinds[0], type):
        raise ValueError(f"an engine flag needs a plain or optional type, got {hint!r}")
    return kinds[0]
