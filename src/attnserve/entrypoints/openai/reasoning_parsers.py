"""`--reasoning-parser`: a reply's thinking (`<think>`...`</think>`) split from its answer, as
vLLM's parsers of the same names split it, into `reasoning_content` and `content`.

One `ReasoningStream` per choice reads the reply as it comes, whole or in deltas, so a streamed
reply's `reasoning_content` and `content` deltas add up to what the whole reply gives; a tag cut
across tokens or deltas is held back until it is whole. A reply has at most one thinking block:
a `</think>` ends it (the tag dropped, the rest is content); a later `<think>` is content.

Where the reply starts:
- `deepseek_r1`: inside the thinking (DeepSeek-R1's template opens it in the prompt, so the reply
  may lack `<think>`; a leading one is dropped). With no `</think>`, the whole reply is thinking.
- `qwen3`: inside the thinking when the prompt ends inside an open `<think>` block (the chat
  template opened it); else in the answer, unless the reply starts (after blank space) with
  `<think>`. Qwen3 with `enable_thinking: false` renders a closed, empty block into the prompt:
  the reply is all content.
A reply cut inside its thinking (max_tokens) keeps what it thought as `reasoning_content`.

This module imports nothing heavy: `cli_args` takes the parsers' names from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_START = "<think>"
THINK_END = "</think>"


class _Phase(Enum):
    OPENING = "opening"  # nothing but blank space yet: a `<think>` may still come
    THINKING = "thinking"
    ANSWERING = "answering"


@dataclass(frozen=True)
class ReasoningParser:
    """A parser: its name and whether a reply starts inside the thinking regardless of the
    prompt (`starts_thinking`)."""

    name: str
    starts_thinking: bool

    def thinks_first(self, prompt: str) -> bool:
        """Whether a reply to the rendered `prompt` (text) starts inside the thinking."""
        return self.starts_thinking or prompt_opens_thinking(prompt)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_thinking=True),
    "qwen3": ReasoningParser("qwen3", starts_thinking=False),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`; ValueError listing the known names for another."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}: the known ones are {known}")
    return parser


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the prompt ends inside a `<think>` block (its last `<think>` is not closed)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be
    coming)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """One reply's reader: `feed` each piece of its text in turn (`final` with the last), for
    the thinking and the answer text that piece brings out."""

    def __init__(self, thinking: bool) -> None:
        """`thinking`: the reply starts inside the thinking (`ReasoningParser.thinks_first`)."""
        self._phase = _Phase.THINKING if thinking else _Phase.OPENING
        self._held = ""  # text not given out yet: a tag may begin in it
        self.thought = thinking  # whether the reply has had any thinking
        self._fresh = True  # no thinking given out yet: a leading `<think>` is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` brings out; with `final`, all that was held."""
        self._held += text
        reasoning = content = ""
        if self._phase is _Phase.OPENING:
            content = self._open(final)
        if self._phase is _Phase.THINKING:
            reasoning, content = self._think(final)
        if self._phase is _Phase.ANSWERING:
            content += self._held
            self._held = ""
        return reasoning, content

    def _open(self, final: bool) -> str:
        """Leave the opening phase once the reply's start shows (content held until then)."""
        start = self._held.lstrip()
        if start.startswith(THINK_START):
            self._held = start[len(THINK_START) :]
            self._phase = _Phase.THINKING
            self.thought = True
            self._fresh = False
        elif final or not THINK_START.startswith(start):
            self._phase = _Phase.ANSWERING
        return ""

    def _think(self, final: bool) -> tuple[str, str]:
        """The thinking up to `</think>` (a `<think>` before it dropped), holding back a tag's
        beginning; past the tag, the answer phase."""
        if self._fresh:
            start = self._held.lstrip()
            if start.startswith(THINK_START):
                self._held = start[len(THINK_START) :]
                self._fresh = False
            elif THINK_START.startswith(start) and not final:
                return "", ""  # maybe a `<think>` the prompt's open block does not need
        reasoning, tag, rest = self._held.partition(THINK_END)
        if tag:
            self._held = rest
            self._phase = _Phase.ANSWERING
            return reasoning, ""
        keep = 0 if final else _partial_tag(reasoning, THINK_END)
        self._held = reasoning[len(reasoning) - keep :]
        given = reasoning[: len(reasoning) - keep]
        self._fresh = self._fresh and not given.strip()
        return given, ""
