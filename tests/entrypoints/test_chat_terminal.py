"""`attnserve chat` as a user runs it in a terminal: the real command in a pseudo-terminal, on the
tiny chat model, keys pressed as a user presses them. Ctrl-C with text typed on the line clears
the line and the chat goes on (the next line is read alone); Ctrl-C or Ctrl-D on an empty line
leaves with exit code 0.

A key is pressed only once the chat waits for one: what it shows last (a prompt, an echo) has
been read, and its main thread sleeps (the state in /proc), which after drawing is readline's wait
for a key. Python's readline runs a signal's handler only when the signal interrupts that wait: a
Ctrl-C that came while it still drew would be held until the line ends, and the test would hang.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnserve.entrypoints.chat import KEYS
from tests.conftest import HANG_GUARD_S, wait_until
from tests.entrypoints.openai_server import SRC

pytestmark = pytest.mark.skipif(
    not hasattr(os, "openpty") or not hasattr(os, "login_tty") or not Path("/proc/self").is_dir(),
    reason="needs pseudo-terminals and /proc",
)

CTRL_C = b"\x03"
CTRL_D = b"\x04"
PROMPT = b"you> "
# The chat's stdin, stdout and stderr become the terminal, and its controlling terminal (where
# Ctrl-C is SIGINT to it), in a new session; then it runs `python ARGS`.
LOGIN = "import os, sys; os.login_tty(0); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"


class Terminal:
    """A command in a pseudo-terminal: keys written to it, what it shows read back."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.fd, terminal = os.openpty()
        command = [sys.executable, "-c", LOGIN, *args]
        self.process = subprocess.Popen(
            command, stdin=terminal, stdout=terminal, stderr=terminal, env=env
        )
        os.close(terminal)
        self.shown = b""
        self.expected = 0  # how much of `shown` the expects have gone past
        self.closed = False

    def _read(self, timeout: float) -> None:
        """Whatever the command shows within `timeout` s; EOF once no process holds the terminal
        (Linux reports it as EIO)."""
        if self.closed:
            time.sleep(timeout)
            return
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                data = os.read(self.fd, 4096)
            except OSError:
                data = b""
            self.shown += data
            self.closed = not data

    def expect(self, text: bytes) -> bytes:
        """Wait until `text` is shown past the previous expect's; return what came between."""
        deadline = time.monotonic() + HANG_GUARD_S
        while (at := self.shown.find(text, self.expected)) < 0:
            if self.closed:
                raise AssertionError(f"the terminal closed before {text!r}:\n{self.shown!r}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {HANG_GUARD_S:.0f} s:\n{self.shown!r}")
            self._read(timeout=1.0)
        between = self.shown[self.expected : at]
        self.expected = at + len(text)
        return between

    def _sleeps(self) -> bool:
        pid = self.process.pid
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "S"

    def press(self, keys: bytes) -> None:
        """Type `keys` once the command waits for a key (see the module's docstring)."""
        wait_until(self._sleeps, "the chat to wait for a key")
        os.write(self.fd, keys)

    def exit_code(self) -> int:
        """Wait for the command to end, reading what it still shows."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {HANG_GUARD_S:.0f} s:\n{self.shown!r}")
            self._read(timeout=0.1)
        return self.process.returncode

    def close(self) -> None:
        if self.process.poll() is None:  # a failed test: the chat still runs
            self.process.kill()
            self.process.wait()
        os.close(self.fd)


@pytest.fixture
def chat(tiny_chat_model_dir: Path, tmp_path: Path) -> Iterator[Terminal]:
    """`attnserve chat` on the tiny chat model, its prompt shown; its history under tmp_path."""
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "HOME": str(tmp_path),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "INPUTRC": os.devnull,  # readline's defaults, not this machine's settings
        "TERM": "dumb",
    }
    args = ["-m", "attnserve.cli", "chat", "--model", str(tiny_chat_model_dir), "--device", "cpu"]
    terminal = Terminal([*args, "--max-model-len", "128"], env)
    try:
        terminal.expect(PROMPT)
        yield terminal
    finally:
        terminal.close()


def test_ctrl_c_clears_a_typed_line_and_the_chat_goes_on(chat: Terminal, tmp_path: Path) -> None:
    chat.press(b"not sent")
    chat.expect(b"not sent")  # readline has it on the line
    chat.press(CTRL_C)
    assert chat.expect(PROMPT) == b"\r\n"  # a new prompt, on a new line
    chat.press(b"/help\r")  # had the typed text stayed, this would be a turn for the model
    chat.expect(KEYS.encode())
    chat.expect(PROMPT)
    chat.press(CTRL_D)
    assert chat.exit_code() == 0
    assert chat.expect(b"\n") == b"\r"  # left on a new line
    assert b"model> " not in chat.shown
    history = (tmp_path / "state" / "attnserve" / "chat_history").read_text()
    assert "/help" in history and "not sent" not in history


def test_ctrl_c_on_an_empty_line_leaves(chat: Terminal) -> None:
    chat.press(CTRL_C)
    assert chat.exit_code() == 0
    assert chat.expect(b"\n") == b"\r"  # left on a new line
