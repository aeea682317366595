"""The tool-call readers on fixed model outputs: whole, and streamed in every split (each piece
one character, and the text cut at every position), which must give the same content and calls.
The parser names are those `attnserve serve --tool-call-parser` (and `--reasoning-parser`)
offer; without one, the server takes the parser the model's chat template calls for."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import pytest

from attnserve.config.frontend import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    FrontendArgs,
    auto_tool_call_parser,
)
from attnserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from attnserve.entrypoints.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesStream,
    Llama3JsonStream,
    NamedCallStream,
    RequiredCallsStream,
    ToolCallStream,
    merged_calls,
    parser_for_chat_template,
)

Reader = Callable[[], ToolCallStream]
Calls = list[tuple[str, dict]]


def read(new_reader: Reader, pieces: list[str]) -> tuple[str, Calls, int]:
    """Content, calls (name, parsed arguments) and how many call deltas had an id."""
    reader = new_reader()
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, new = reader.feed(piece, final=i == len(pieces) - 1)
        content += text
        deltas += new
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in merged_calls(deltas)]
    return content, calls, sum(d.id is not None for d in deltas)


def every_split(new_reader: Reader, text: str) -> tuple[str, Calls]:
    """The reading of `text`, the same whole, character by character and cut anywhere."""
    content, calls, starts = read(new_reader, [text])
    assert starts == len(calls)
    assert read(new_reader, list(text))[:2] == (content, calls)
    for cut in range(1, len(text)):
        assert read(new_reader, [text[:cut], text[cut:]])[:2] == (content, calls), cut
    return content, calls


HERMES_TWO = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
)


def test_parser_names_match_the_cli() -> None:
    assert tuple(TOOL_CALL_PARSERS) == TOOL_CALL_PARSER_NAMES
    assert tuple(sorted(REASONING_PARSERS)) == REASONING_PARSER_NAMES


def test_hermes_content_and_two_calls() -> None:
    content, calls = every_split(HermesStream, HERMES_TWO)
    assert content == "Let me check.\n"
    assert calls == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("get_time", {"tz": "CET"}),
    ]


def test_hermes_without_parallel_calls_keeps_the_first() -> None:
    _, calls = every_split(lambda: HermesStream(parallel_tool_calls=False), HERMES_TWO)
    assert calls == [("get_weather", {"city": "Paris", "unit": "C"})]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Plain answer, a < b and <tool", "Plain answer, a < b and <tool", []),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),  # cut before the close
        ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", {"x": 1})]),
    ],
)
def test_hermes_edge_cases(text: str, content: str, calls: Calls) -> None:
    assert every_split(HermesStream, text) == (content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [
            ("get_weather", {"city": "Oslo"})
        ]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}',
         "", [("a", {}), ("b", {"n": 2})]),
        ("  The weather is fine.", "  The weather is fine.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: content
        ('{"name": "f", "parameters": {}} more', '{"name": "f", "parameters": {}} more', []),
    ],
)  # fmt: skip
def test_llama3_json(text: str, content: str, calls: Calls) -> None:
    assert every_split(Llama3JsonStream, text) == (content, calls)


def test_named_call_streams_its_arguments() -> None:
    arguments = '{"city": "Lima"}'
    assert every_split(lambda: NamedCallStream("get_weather"), arguments) == (
        "",
        [("get_weather", {"city": "Lima"})],
    )


def test_required_calls_each_once_complete() -> None:
    text = '[{"name": "a", "parameters": {"s": "x]}"}}, {"name": "b", "parameters": {}}]'
    content, calls = every_split(RequiredCallsStream, text)
    assert content == "" and calls == [("a", {"s": "x]}"}), ("b", {})]
    reader = RequiredCallsStream()
    _, deltas = reader.feed(text[: text.index(", {")], final=False)  # the first object whole
    assert [d.function.name for d in deltas] == ["a"]


QWEN_TEMPLATE = "{%- if tools %}<tools>{{ tool }}</tools><tool_call>\n{{ call }}\n</tool_call>"
LLAMA31_TEMPLATE = '{%- if builtin_tools %}<|python_tag|>{{ call }}{%- endif %}"parameters"'


@pytest.mark.parametrize(
    ("template", "parser"),
    [(QWEN_TEMPLATE, "hermes"), (LLAMA31_TEMPLATE, "llama3_json"), ("{{ messages }}", None),
     (None, None)],
)  # fmt: skip
def test_the_parser_comes_from_the_chat_templates_tool_call_format(
    template: str | None, parser: str | None
) -> None:
    assert parser_for_chat_template(template) == parser


def _serve_args(*flags: str) -> FrontendArgs:
    parser = argparse.ArgumentParser()
    FrontendArgs.add_cli_args(parser)
    return FrontendArgs.from_cli_args(parser.parse_args(list(flags)))


def test_auto_tool_choice_takes_the_flag_then_the_template() -> None:
    assert auto_tool_call_parser(_serve_args(), "hermes") == "hermes"
    assert auto_tool_call_parser(_serve_args("--tool-call-parser", "llama3_json"), "hermes") == (
        "llama3_json"
    )
    assert auto_tool_call_parser(_serve_args(), None) is None  # the server's own format
    assert auto_tool_call_parser(_serve_args("--enable-auto-tool-choice"), None) is None
