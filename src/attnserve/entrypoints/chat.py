"""The terminal chat: a conversation with the model, replies streamed as they are generated.

A one-line banner names the model and the commands (`/reset` forgets the conversation, `/help`
lists the commands, `/quit` leaves); empty lines are ignored. In a terminal, lines are read
through readline (editing, and a history kept in $XDG_STATE_HOME/attnserve/chat_history), and
Ctrl-C at the prompt with text typed on the line drops that text and shows a new prompt on a new
line, the chat going on. Ctrl-C during a reply stops it (the request is aborted between engine
steps, nothing more is shown, and what was shown stays in the conversation) and returns to the
prompt. Ctrl-C on an empty line (or at any prompt when stdin is not a terminal), a second Ctrl-C
before a reply has stopped, Ctrl-D on an empty line or `/quit` leave, on a new line.

Replies run up to the model's context limit unless `--max-tokens` says less (as vLLM's chat); a
reply cut by either ends with a mark saying so and how to go further (`cut_mark`), never
silently mid-sentence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TextIO

from attnserve.engine.llm_engine import LLMEngine
from attnserve.outputs import CompletionOutput
from attnserve.sampling_params import RequestOutputKind, SamplingParams

HISTORY_LENGTH = 1000
HELP = "/reset forgets the conversation, /help shows this, /quit leaves"
KEYS = "Ctrl-C stops a reply or clears a typed line, Ctrl-C on an empty line or Ctrl-D leaves"
Reader = Callable[[str], str]  # like `input`: the line without its newline; EOFError at the end


class LineCleared(Exception):
    """From a `Reader`: Ctrl-C with text typed on the line; the text is dropped, the chat goes on.
    (Ctrl-C on an empty line is a KeyboardInterrupt.)"""


def stream_reply(
    engine: LLMEngine,
    request_id: str,
    prompt: str,
    params: SamplingParams,
    out: TextIO,
    stop: threading.Event | None = None,
) -> str:
    """Generate one reply, writing text to `out` as it arrives (and a `cut_mark` when a limit
    cut it); return the text written. When `stop` is set, the request is aborted after the step
    in progress."""
    engine.add_request(request_id, prompt, params)
    text = ""
    last: CompletionOutput | None = None
    try:
        while engine.has_unfinished_requests() and not (stop is not None and stop.is_set()):
            outputs = engine.step()
            if stop is not None and stop.is_set():  # stopped during the step: show nothing more
                break
            for output in outputs:
                if output.request_id == request_id:
                    last = output.outputs[0]
                    out.write(last.text[len(text) :])
                    out.flush()
                    text = last.text
    finally:
        engine.abort_request(request_id)  # a no-op once the request has finished
        if last is not None and last.finish_reason == "length":
            out.write(cut_mark(len(last.token_ids), params.max_tokens))
        out.write("\n")
    return text


def cut_mark(num_tokens: int, max_tokens: int | None) -> str:
    """What ends a reply a limit cut: `--max-tokens` (when it was reached), else the context."""
    if max_tokens is not None and num_tokens >= max_tokens:
        return f" [cut at {num_tokens} tokens: --max-tokens to raise]"
    return f" [cut at {num_tokens} tokens: the conversation fills the context; /reset]"


@contextlib.contextmanager
def _ctrl_c_stops(stop: threading.Event) -> Iterator[None]:
    """While inside: the first Ctrl-C sets `stop`, a second raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def history_file() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "attnserve" / "chat_history"


def read_edited_line(prompt: str) -> str:
    """`input` through readline, where Ctrl-C with text typed on the line raises LineCleared:
    readline still holds that text when the KeyboardInterrupt arrives."""
    import readline

    try:
        return input(prompt)
    except KeyboardInterrupt:
        if readline.get_line_buffer():
            raise LineCleared from None
        raise


@contextlib.contextmanager
def line_editing() -> Iterator[Reader]:
    """The chat's `Reader`: when stdin is a terminal, `read_edited_line` (readline editing, a
    kept history, Ctrl-C clearing a typed line); otherwise plain `input`."""
    if not sys.stdin.isatty():
        yield input
        return
    import readline

    path = history_file()
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(HISTORY_LENGTH)
    try:
        yield read_edited_line
    finally:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)


def chat_loop(
    engine: LLMEngine,
    params: SamplingParams,
    model_name: str,
    read: Reader = input,
    system: str | None = None,
    out: TextIO = sys.stdout,
) -> None:
    """Read user turns with `read` until /quit, its end or Ctrl-C on an empty line (a cleared
    line goes on to a new prompt); keep the conversation."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    out.write(f"chatting with {model_name}: {HELP}\n")
    for turn in itertools.count():
        try:
            line = read("you> ").strip()
        except LineCleared:
            out.write("\n")
            continue
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if not line:
            continue
        if line == "/quit":
            return
        if line == "/help":
            out.write(f"{HELP}; {KEYS}\n")
            continue
        if line == "/reset":
            history = list(start)
            out.write("(the conversation is forgotten)\n")
            continue
        history.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        out.write("model> ")
        stop = threading.Event()
        try:
            with _ctrl_c_stops(stop):
                reply = stream_reply(engine, f"chat-{turn}", str(prompt), params, out, stop)
        except KeyboardInterrupt:  # the second Ctrl-C: leave
            return
        history.append({"role": "assistant", "content": reply})
