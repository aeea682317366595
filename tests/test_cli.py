"""The `attnserve` command as a user runs it: answers, one-line errors with exit code 2 for
every mistake (a subprocess shows there is no traceback; the rest run `main` in process), the
model as --model on every model command, help on every flag, the cache command."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnserve import __version__
from attnserve.cli import build_parser, main
from attnserve.engine.arg_utils import EngineArgs
from attnserve.model.model_cache import CACHE_ENV
from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]


def _attnserve(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "attnserve.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=HANG_GUARD_S,
    )


def test_generate_answers_with_the_default_model() -> None:
    result = _attnserve(
        "generate", "--chat", "--max-tokens", "24", "What is the capital of France?"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "INFO" not in result.stderr  # quiet logs by default


def test_an_unusable_device_is_one_line_and_exit_code_2() -> None:
    result = _attnserve("generate", *TINY, "--device", "cuda:x", "hi")
    assert result.returncode == 2
    assert result.stderr == "attnserve: error: device 'cuda:x': N in 'cuda:N' is a GPU number\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--model", "/no/such/model", "hi"], "/no/such/model"),
        (["generate", *TINY, "--attention-backend", "NOPE", "hi"], "NOPE"),
        (["generate", *TINY, "--max-tokens", "0", "hi"], "max_tokens"),
        (["generate", *TINY, "--device", "mps", "hi"], "device must be"),
        (["generate", *TINY, "hello"], "this model has no tokenizer"),
        (["generate", *TINY, "--quantization", "int4", "hi"], "unknown quantization 'int4'"),
        (["generate", *TINY, "--quantization", "gguf", "hi"], "'gguf' needs GGUF weights"),
        (["chat", *TINY], "this model has no chat template"),
        (["serve", *TINY, "--port", "70000"], "--port must be in 0..65535"),
        (["bench", "latency", *TINY, "--json", "/no/such/dir/x.json"], "/no/such/dir/x.json"),
        (["backends", "--num-heads", "0"], "num_heads must be a positive int"),
        (["generate", "--max-tokens", "x", "hi"], "invalid int value: 'x'"),
        (["serve", "--model", "a", "b"], "the model is given twice: 'a' and 'b'"),
        (["cache", "nope"], "invalid choice: 'nope'"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_a_mistake_is_one_line_and_exit_code_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(args)
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_serve_refuses_a_busy_port_before_loading_anything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "attnserve.entrypoints.openai.api_server", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", *TINY, "--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"attnserve: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )
    assert "attnserve.entrypoints.openai.api_server" not in sys.modules


def test_generate_suggests_chat_when_a_chat_model_answers_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the default model's first token here is <|im_end|>, as in HF: an empty answer
    assert main(["generate", "--max-model-len", "256", "What is the capital of France?"]) == 0
    captured = capsys.readouterr()
    assert "> What is the capital of France?\n\n" in captured.out
    assert captured.err == (
        "attnserve: an empty answer: this is a chat model; --chat applies its chat template\n"
    )


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench latency", "backends"])
def test_every_model_command_takes_model_as_a_flag(command: str) -> None:
    extra = ["hi"] if command == "generate" else []
    args = build_parser().parse_args([*command.split(), "--model", "m", *extra])
    assert args.model == "m"


def test_serve_also_takes_the_model_positionally() -> None:
    assert build_parser().parse_args(["serve", "m", "--port", "1"]).model == "m"
    assert build_parser().parse_args(["serve", "m", "--model", "m"]).model == "m"
    assert build_parser().parse_args(["serve"]).model is None
    assert EngineArgs.from_cli_args(build_parser().parse_args(["serve", "m"])).model == "m"


def test_backends_names_the_selected_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    assert "selected: TORCH_SDPA" in capsys.readouterr().out


def test_backends_reports_the_embedded_model_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    # SmolLM2-135M: 9 heads of 64 over 3 KV heads, as every other command's default model
    assert main(["backends", "--device", "cpu"]) == 0
    assert "num_heads=9, num_kv_heads=3, head_size=64," in capsys.readouterr().out


def test_backends_takes_the_shape_from_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    # llama-tiny: 4 heads of size 16 over 2 KV heads; a flag still wins over the model
    assert main(["backends", "--model", "llama-tiny", "--device", "cpu", "--head-size", "8"]) == 0
    assert "num_heads=4, num_kv_heads=2, head_size=8," in capsys.readouterr().out


def test_cache_list_and_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    (tmp_path / "model-a").mkdir()
    (tmp_path / "model-a" / "weights").write_bytes(b"x" * 2_000_000)
    (tmp_path / ".staging-model-b-123").mkdir()
    assert main(["cache", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == f"{tmp_path}: 2 entries, 2.0 MB"
    assert listed[1].split()[:3] == ["0.0", "MB", ".staging-model-b-123"]
    assert listed[1].endswith("(unfinished: a conversion running or killed)")
    assert listed[2].split() == ["2.0", "MB", "model-a"]
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"removed 2 entries (2.0 MB) from {tmp_path}\n"
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


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


def test_help_shows_every_engine_flag_with_its_field_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in shown, f.name
        assert " ".join(f.metadata["help"].split()) in shown, f.name
    assert "[MODEL]" in shown and "--log-level" in shown


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "attnserve.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_version_and_an_option_before_any_command() -> None:
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"attnserve {__version__}"
    unknown = _cli("--foo")
    assert unknown.returncode == 2 and "unrecognized argument --foo" in unknown.stderr
    assert "Traceback" not in unknown.stderr


def test_output_cut_short_by_its_reader_ends_quietly() -> None:
    """`attnserve backends | head -1`: the reader closes the pipe after one line."""
    command = [sys.executable, "-m", "attnserve.cli", "backends"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    errors = process.stderr.read().decode()
    assert process.wait(timeout=HANG_GUARD_S) == 0
    assert "Traceback" not in errors and "BrokenPipe" not in errors


def test_generate_takes_token_ids_for_a_model_without_tokenizer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attnserve import LLM, SamplingParams

    tiny = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
    assert main(["generate", *tiny, "--max-tokens", "3", "--prompt-token-ids", "5,6,7"]) == 0
    printed = capsys.readouterr().out.splitlines()
    llm = LLM("llama-tiny", load_format="dummy", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    (expected,) = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    assert printed[:2] == ["> 5,6,7", str(expected.outputs[0].token_ids)]
    assert main(["generate", *tiny, "--prompt-token-ids", "5,x"]) == 2
    assert "not a list of token ids" in capsys.readouterr().err
