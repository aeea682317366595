"""The `attnserve` command through a subprocess, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
