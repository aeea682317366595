"""A request's structured-output constraint, from whichever field gave it (at most one may):
`response_format` (json_object, json_schema), vLLM's `structured_outputs`, the older `guided_*`
fields, or, for tool calls, `tool_choice` (a named function: its arguments' schema; "required":
an array of calls, each `{"name", "parameters"}` of one of the tools; one at most without
`parallel_tool_calls`). A spec the checks refuse is a 400 naming the field; one the grammar
compiler refuses, or past the server's size or compile-time limit, is a 400 with the reason, naming
the field too (at submission, from the engine: `constraint_field`). A tool's parameters schema is
named `tools[i].function.parameters`: a named function's is compiled as the constraint; for
"required", each tool's schema is converted to a grammar here first (no token masks: quick), so
the one the compiler refuses is named, not the array of calls built from them. JSON comes out
compact (`StructuredOutputsParams`' default) from every field; only vLLM's
`structured_outputs.disable_any_whitespace: false` asks for free whitespace.
"""

from __future__ import annotations

import re
from typing import Any

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol_structured import (
    ChatCompletionTool,
    NamedToolChoice,
    StructuredOutputsFields,
    StructuredOutputsRequest,
)
from attnserve.output_constraints import StructuredOutputsParams, build_grammar

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _spec(param: str, **fields: Any) -> StructuredOutputsParams:
    """The spec of `fields`; a 400 naming `param` (in its message too) for one refused."""
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as error:
        message = str(error)
        if param != "structured_outputs":
            message = re.sub(r"^structured_outputs\.\w+", param, message)
        raise ApiError(400, message, param) from None


def _from_response_format(request: StructuredOutputsFields) -> StructuredOutputsParams | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _spec("response_format", json_object=True)
    if response_format.json_schema is None:
        raise ApiError(400, "response_format json_schema needs its json_schema", "response_format")
    schema = response_format.json_schema.schema_
    if schema is None:
        param = "response_format.json_schema.schema"
        raise ApiError(400, f"{param} is missing: the JSON schema the reply must follow", param)
    return _spec("response_format.json_schema.schema", json=schema)


def _from_structured_outputs(
    fields: StructuredOutputsRequest | None,
) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    values = fields.model_dump(exclude_unset=True)
    if "json_" in values:
        values["json"] = values.pop("json_")
    return _spec("structured_outputs", **values)


def _from_guided(request: StructuredOutputsFields) -> tuple[str, StructuredOutputsParams] | None:
    given = [(name, getattr(request, name)) for name in _GUIDED if getattr(request, name)]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ApiError(400, f"at most one of the guided_* fields: got {names}", given[1][0])
    name, value = given[0]
    return name, _spec(name, **{_GUIDED[name]: value})


def structured_outputs(request: StructuredOutputsFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; 400 when several fields give one."""
    found = {
        "response_format": _from_response_format(request),
        "structured_outputs": _from_structured_outputs(request.structured_outputs),
    }
    guided = _from_guided(request)
    if guided is not None:
        found[guided[0]] = guided[1]
    given = {name: spec for name, spec in found.items() if spec is not None}
    if len(given) > 1:
        names = " and ".join(given)
        raise ApiError(400, f"{names} each constrain the output: give one", list(given)[1])
    return next(iter(given.values()), None)


def parameters_field(index: int) -> str:
    """The request field of the `index`th tool's parameters schema."""
    return f"tools[{index}].function.parameters"


def named_tool_spec(tools: list[ChatCompletionTool], index: int) -> StructuredOutputsParams:
    """The output is the arguments of the function `tools[index]`."""
    return _spec(parameters_field(index), json=tools[index].function.parameters_schema)


def required_tools_spec(
    tools: list[ChatCompletionTool], parallel_tool_calls: bool
) -> StructuredOutputsParams:
    """The output is a JSON array of calls to the tools (one at most when not parallel); a
    400 naming the first tool whose parameters schema is refused."""
    for index in range(len(tools)):
        field = parameters_field(index)
        try:
            build_grammar(named_tool_spec(tools, index))
        except ValueError as error:
            raise ApiError(400, f"invalid {field}: {error}", field) from None
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters_schema,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return _spec("tools", json=schema)


def constraint_field(request: StructuredOutputsFields) -> str | None:
    """The request field its output constraint came from, as a client wrote it (for the
    compiler's errors): a JSON schema of `response_format` is `response_format.json_schema.schema`,
    vLLM's field `structured_outputs.KIND`, a named function's `tools[i].function.parameters`,
    "required" calls `tools`; None without one."""
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_schema":
        return "response_format.json_schema.schema"
    if response_format is not None and response_format.type == "json_object":
        return "response_format"
    guided = next((name for name in _GUIDED if getattr(request, name)), None)
    if guided is not None:
        return guided
    fields = request.structured_outputs
    if fields is not None:
        kinds = ("json_", "regex", "choice", "grammar", "json_object")
        kind = next((kind for kind in kinds if getattr(fields, kind)), "json")
        return f"structured_outputs.{kind.rstrip('_')}"
    return _tool_field(request)


def _tool_field(request: StructuredOutputsFields) -> str | None:
    choice = getattr(request, "tool_choice", None)
    tools: list[ChatCompletionTool] = getattr(request, "tools", None) or []
    if choice == "required" or (tools and choice in (None, "auto")):
        return "tools"  # "auto": the server's own format constrains the calls
    if not isinstance(choice, NamedToolChoice):
        return None
    names = [tool.function.name for tool in tools]
    name = choice.function.name
    return parameters_field(names.index(name)) if name in names else None
