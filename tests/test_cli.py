"""The `attnserve` command through a subprocess, as a user runs it, and its help texts."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from attnserve.cli import build_parser
from attnserve.engine.arg_utils import EngineArgs

ROOT = Path(__file__).resolve().parents[1]


def _attnserve(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "attnserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def test_generate_answers_with_the_default_model() -> None:
    result = _attnserve(
        "generate", "--chat", "--max-tokens", "24", "What is the capital of France?"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_text_prompt_for_a_model_without_tokenizer(tiny_llama_dir: Path) -> None:
    result = _attnserve("generate", "--model", str(tiny_llama_dir), "--device", "cpu", "hello")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "attnserve: error: this model has no tokenizer: pass prompts as token id lists"
    )


def test_bad_input_is_one_line_and_exit_code_2() -> None:
    for args, message in [
        (["generate", "--model", "/no/such/model", "hi"], "/no/such/model"),
        (["generate", "--attention-backend", "NOPE", "--max-tokens", "2", "hi"], "NOPE"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    ]:
        result = _attnserve(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], result.stderr


def test_backends_names_the_selected_backend() -> None:
    result = _attnserve("backends", "--device", "cpu", "--dtype", "float32")
    assert result.returncode == 0
    assert "selected: TORCH_SDPA" in result.stdout


def _flag_helps(parser: argparse.ArgumentParser, command: str) -> Iterator[tuple[str, str]]:
    """(command and flag, its help) for every argument of `parser` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _flag_helps(subparser, f"{command} {name}")
        elif action.dest != "help":
            yield f"{command} {'/'.join(action.option_strings) or action.dest}", action.help or ""


def test_every_flag_has_help() -> None:
    missing = [
        flag for flag, help_text in _flag_helps(build_parser(), "attnserve") if not help_text
    ]
    assert missing == []


def test_help_shows_every_engine_flag_with_its_field_help() -> None:
    result = _attnserve("serve", "--help")
    assert result.returncode == 0, result.stderr
    shown = " ".join(result.stdout.split())
    for f in dataclasses.fields(EngineArgs):
        flag = f.name if f.name == "model" else "--" + f.name.replace("_", "-")
        assert flag in shown, flag
        assert " ".join(f.metadata["help"].split()) in shown, f.name
