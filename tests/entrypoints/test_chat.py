"""The terminal chat on the embedded default model, with scripted lines: the banner, empty lines
ignored, /reset, /help and /quit, Ctrl-C (a real SIGINT) stopping a reply (nothing more shown
once pressed), then leaving, and Ctrl-C at the prompt clearing a typed line or, on an empty one,
leaving. (test_chat_terminal.py presses the keys in a real terminal.)"""

from __future__ import annotations

import io
import signal

import pytest

from attnserve import LLM, SamplingParams
from attnserve.engine.llm_engine import LLMEngine
from attnserve.entrypoints.chat import HELP, KEYS, LineCleared, chat_loop, read_edited_line
from attnserve.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=24)
QUESTION = "What is the capital of France?"
LONG = "Count from 1 to 100, one number per line."


@pytest.fixture(scope="module")
def engine(default_llm: LLM) -> LLMEngine:
    """The shared default model's engine (tests/conftest.py); every test leaves it idle."""
    return default_llm.llm_engine


class Script:
    """Reads like `input`: the scripted lines (an exception is raised), then EOF (Ctrl-D)."""

    def __init__(self, *lines: str | type[BaseException]) -> None:
        self.lines = list(lines)
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if isinstance(line, str):
            return line
        raise line


class CtrlC(io.StringIO):
    """The terminal: when a reply's first text arrives, the user presses Ctrl-C `times` times
    (SIGINT raised in this process; its handler runs before `raise_signal` returns)."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times
        self.in_reply = False

    def write(self, text: str) -> int:
        written = super().write(text)
        if text == "model> ":
            self.in_reply = True
        elif self.in_reply and text.strip():
            while self.times:
                self.times -= 1
                signal.raise_signal(signal.SIGINT)
        return written


def replies(out: io.StringIO) -> list[str]:
    """The replies shown, each without the newline that ends it."""
    return [turn.removesuffix("\n") for turn in out.getvalue().split("model> ")[1:]]


def _all_free(engine: LLMEngine) -> bool:
    return not engine.has_unfinished_requests() and engine.stats()["kv_cache_usage"] == 0


def _record_prompts(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    prompts: list[str] = []
    add = engine.add_request

    def recording(request_id: str, prompt: str, params: SamplingParams) -> None:
        prompts.append(prompt)
        add(request_id, prompt, params)

    monkeypatch.setattr(engine, "add_request", recording)
    return prompts


def test_banner_turns_reset_and_quit(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _record_prompts(engine, monkeypatch)
    script = Script("", "   ", QUESTION, "/reset", "Hi", "/quit", "never read")
    out = io.StringIO()
    chat_loop(engine, GREEDY, "SmolLM2", script, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "chatting with SmolLM2: /reset forgets the conversation, /help shows this, /quit leaves"
    )
    assert len(prompts) == 2  # the empty lines were not sent
    assert "Paris" in lines[1] and lines[1].startswith("model> ")
    assert QUESTION in prompts[0] and QUESTION not in prompts[1] and "Hi" in prompts[1]
    assert script.prompts == ["you> "] * 6 and script.lines == ["never read"]
    assert _all_free(engine)


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_reply = SamplingParams(temperature=0, max_tokens=48)
    whole = io.StringIO()
    chat_loop(engine, long_reply, "m", Script(LONG), out=whole)
    prompts = _record_prompts(engine, monkeypatch)
    out = CtrlC(times=1)
    chat_loop(engine, long_reply, "m", Script(LONG, QUESTION), out=out)
    (full,) = replies(whole)
    stopped, answered = replies(out)
    assert stopped and full.startswith(stopped) and len(stopped) < len(full)
    assert "Paris" in answered
    assert stopped in prompts[1]  # what was shown stays in the conversation
    assert out.getvalue().endswith("\n") and _all_free(engine)


def test_a_second_ctrl_c_leaves(engine: LLMEngine) -> None:
    script = Script(LONG, QUESTION)
    out = CtrlC(times=2)
    chat_loop(engine, SamplingParams(temperature=0, max_tokens=48), "m", script, out=out)
    assert script.lines == [QUESTION]  # left without reading another line
    assert out.getvalue().endswith("\n") and _all_free(engine)


@pytest.mark.parametrize("key", [EOFError, KeyboardInterrupt], ids=["ctrl-d", "ctrl-c"])
def test_ctrl_d_or_ctrl_c_on_an_empty_line_leaves_on_a_new_line(
    engine: LLMEngine, key: type[BaseException]
) -> None:
    out = io.StringIO()
    chat_loop(engine, GREEDY, "m", Script(key, QUESTION), out=out)
    assert out.getvalue().count("\n") == 2 and out.getvalue().endswith("\n")


def test_ctrl_c_on_a_typed_line_clears_it_and_the_chat_goes_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _record_prompts(engine, monkeypatch)
    script = Script(LineCleared, "/help", "/quit")
    out = io.StringIO()
    chat_loop(engine, GREEDY, "m", script, out=out)
    assert out.getvalue().splitlines()[1:] == ["", f"{HELP}; {KEYS}"]  # a new line, a new prompt
    assert script.prompts == ["you> "] * 3 and prompts == []


@pytest.mark.parametrize(("typed", "raised"), [("not sent", LineCleared), ("", KeyboardInterrupt)])
def test_the_terminal_reader_tells_a_typed_line_from_an_empty_one(
    monkeypatch: pytest.MonkeyPatch, typed: str, raised: type[BaseException]
) -> None:
    """Ctrl-C during `input`: what readline holds on the line then decides."""
    readline = pytest.importorskip("readline")

    def ctrl_c(prompt: str) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    monkeypatch.setattr(readline, "get_line_buffer", lambda: typed)
    with pytest.raises(raised):
        read_edited_line("you> ")


def test_help_lists_the_commands_and_goes_to_no_model(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = _record_prompts(engine, monkeypatch)
    out = io.StringIO()
    chat_loop(engine, GREEDY, "m", Script("/help", "/quit"), out=out)
    assert prompts == [] and "/reset" in out.getvalue().splitlines()[1]
    assert "Ctrl-C stops a reply" in out.getvalue()


def test_a_ctrl_c_during_a_step_shows_nothing_more(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the engine steps (not while text is written): that step's text is not
    shown; the reply ends with what the step before it had."""
    step = engine.step
    texts: list[str] = []  # the reply's whole text after each step

    def interrupted_step() -> list[RequestOutput]:
        outputs = step()
        texts.extend(o.outputs[0].text for o in outputs)
        if len(texts) == 3:  # Ctrl-C during the reply's third step
            signal.raise_signal(signal.SIGINT)
        return outputs

    monkeypatch.setattr(engine, "step", interrupted_step)
    out = io.StringIO()
    chat_loop(engine, SamplingParams(temperature=0, max_tokens=48), "m", Script(LONG), out=out)
    (shown,) = replies(out)
    assert len(texts) == 3 and texts[1] != texts[2]
    assert shown.rstrip("\n") == texts[1]  # (then the newline of leaving at the end)
    monkeypatch.undo()
    assert _all_free(engine)
