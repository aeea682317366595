"""Command-line flags built from a config dataclass: one `--flag-name` per field, with the help
its `arg(...)` gives, parsed as the field's type (a dict field as a JSON object, a bool as
`--flag/--no-flag`) unless the field names its own argparse settings; the model may be given once,
as MODEL or `--model`. `EngineArgs` and `FrontendArgs` both build their flags here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def arg(default: Any, help_text: str, **flag: Any) -> Any:
    """A field's default and its CLI help; `flag`: argparse settings beyond what the field's
    type implies (`type`, `choices`, `action`)."""
    return dataclasses.field(default=default, metadata={"help": help_text, "flag": flag})


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


def add_cli_args(
    parser: argparse.ArgumentParser, cls: type, positional_model: bool = False
) -> None:
    """One `--flag-name` per field of `cls`, with the field's help; with `positional_model` the
    model may also be given as an optional positional MODEL (as in `vllm serve MODEL`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        help_text = f.metadata["help"]
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model":
            if positional_model:
                parser.add_argument(
                    "model",
                    nargs="?",
                    default=argparse.SUPPRESS,  # absent: keeps --model's value
                    action=ModelOnce,
                    metavar="MODEL",
                    help=f"{help_text}; or --model",
                )
            parser.add_argument(flag, default=None, action=ModelOnce, help=help_text)
            continue
        options = _flag_options(hints[f.name], f.metadata["flag"])
        parser.add_argument(flag, default=f.default, help=help_text, **options)


def from_cli_args(cls: Callable[..., T], args: argparse.Namespace) -> T:
    """The config of `cls` from the parsed flags of its fields."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def _flag_options(hint: Any, given: dict[str, Any]) -> dict[str, Any]:
    if "action" in given:
        return given
    kind = cli_type(hint)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction, **given}
    return {"type": kind, **given}


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
        raise ValueError(f"a flag needs a plain or optional type, got {hint!r}")
    return kinds[0]
