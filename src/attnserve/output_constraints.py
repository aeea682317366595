"""`StructuredOutputsParams`: what a request's output must follow (vLLM 0.26's names), checked up
front, and `load_xgrammar`, the one place the optional xgrammar package is imported.

Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice`
(the output is one of these strings), `grammar` (xgrammar's EBNF) or `json_object=True` (any JSON
object). JSON outputs are compact by default: one line, no whitespace outside strings but the
single spaces of the separators `", "` and `": "` (xgrammar's `any_whitespace=False`; free
whitespace lets a model pad its output with newlines and spaces until `max_tokens`).
`disable_any_whitespace` keeps vLLM's name: None (the default) or True is compact, False asks
for free whitespace between JSON tokens (vLLM's default). A schema may nest at most
`MAX_SCHEMA_DEPTH` objects and arrays (deeper ones would exhaust Python's recursion on their way
to the compiler). A leaf module: it imports nothing of attnserve, so `SamplingParams` and every
layer may use it. What travels to the engine core is this spec (picklable); grammars are compiled
from it where they are used (`build_grammar`: the spec as xgrammar's grammar, before its token
masks are compiled).

Its limits (cache size, largest spec, compile time) are `config.StructuredOutputsConfig`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

XGRAMMAR_HINT = "pip install 'xgrammar>=0.2' (or attnserve[structured])"
MAX_SCHEMA_DEPTH = 128  # objects and arrays nested in a JSON schema (about 64 schema levels)
# xgrammar's messages start with a timestamp and the C++ source line: "[13:12:25] /x/y.cc:83: "
_COMPILER_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def compiler_message(error: Exception) -> str:
    """The compiler's message without its timestamp and source location."""
    return _COMPILER_PREFIX.sub("", str(error).strip())


def load_xgrammar() -> ModuleType:
    """The xgrammar module; ValueError (naming the fix) where it is not installed."""
    try:
        import xgrammar
    except ImportError as error:
        message = f"structured outputs need the xgrammar package: {XGRAMMAR_HINT}"
        raise ValueError(message) from error
    return xgrammar


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # None: compact; False: free whitespace
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        given = [name for name, value in self._constraints().items() if value is not None]
        if len(given) != 1:
            shown = ", ".join(given) or "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {shown}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported (xgrammar has no custom "
                "whitespace); JSON is compact unless disable_any_whitespace is false"
            )

    def _constraints(self) -> dict[str, object]:
        return {
            "json": self.json,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        return next(name for name, value in self._constraints().items() if value is not None)

    @property
    def any_whitespace(self) -> bool:
        """Whether JSON outputs may have free whitespace (asked for with
        `disable_any_whitespace=False`); else they are compact."""
        return self.disable_any_whitespace is False

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the cache's key): the kind, the spec's text
        (a schema's properties keep their order: it is the output's) and the whitespace rule."""
        if self.kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            text = json.dumps(schema, separators=(",", ":"))
        elif self.kind == "choice":
            text = json.dumps(self.choice)
        else:
            text = str(self.regex or self.grammar or "")
        return self.kind, text, self.any_whitespace

    @property
    def ebnf_for_choice(self) -> str:
        """The grammar of `choice`: one of the strings, exactly."""
        literals = (json.dumps(c, ensure_ascii=False) for c in self.choice or [])
        return "root ::= " + " | ".join(literals)


def build_grammar(spec: StructuredOutputsParams, text: str | None = None) -> Any:
    """`spec` as xgrammar's `Grammar` (`text`: its key's text, if known); ValueError with the
    compiler's message for a spec it refuses."""
    grammar = load_xgrammar().Grammar
    any_whitespace = spec.any_whitespace  # compact: xgrammar's separators ", " and ": "
    try:
        if spec.kind == "json":
            schema = spec.key[1] if text is None else text
            return grammar.from_json_schema(schema, any_whitespace=any_whitespace)
        if spec.kind == "json_object":  # any object: no schema to be strict about
            return grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
            )
        if spec.kind == "regex":
            return grammar.from_regex(spec.regex)
        return grammar.from_ebnf(spec.ebnf_for_choice if spec.kind == "choice" else spec.grammar)
    except (RuntimeError, ValueError, TypeError, RecursionError) as error:
        raise ValueError(compiler_message(error)) from None


def _too_deep() -> ValueError:
    return ValueError(
        f"structured_outputs.json nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep"
    )


def _check_depth(schema: Any) -> None:
    """ValueError for a schema nesting more than MAX_SCHEMA_DEPTH objects and arrays (walked
    without recursion)."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _too_deep()
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _check_types(params: StructuredOutputsParams) -> None:
    if params.json is not None:
        if not isinstance(params.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON schema (object or JSON text)")
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise _too_deep() from None
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from error
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        _check_depth(schema)
    for name in ("regex", "grammar", "whitespace_pattern"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"structured_outputs.{name} must be a non-empty string")
    choice = params.choice
    if choice is not None and (
        not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice)
    ):
        raise ValueError("structured_outputs.choice must be a non-empty list of strings")
    if params.json_object is not None and not isinstance(params.json_object, bool):
        raise ValueError("structured_outputs.json_object must be a boolean")
    whitespace = params.disable_any_whitespace
    if whitespace is not None and not isinstance(whitespace, bool):
        raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
