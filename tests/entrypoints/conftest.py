"""Servers that several server test modules share, each started once and stopped after the last
test of this package: the default model (with an API key; no tool flags: tools in the server's
own format) and a tiny
random Llama that carries the default model's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.entrypoints.openai_server import (
    API_KEY,
    TINY_MAX_BYTES,
    TINY_MAX_MODEL_LEN,
    TINY_MODEL,
    ServerProcess,
    tiny_model_with_tokenizer,
)


@pytest.fixture(scope="package")
def default_model_server() -> Iterator[ServerProcess]:
    """`attnserve serve` on the default model (CPU, max_model_len 512), API_KEY required on
    /v1; no tool flags, as the README starts it (its template shows no tool-call format: tools
    go in the server's own format, `generic_tools`)."""
    args = ["--device", "cpu", "--max-model-len", "512"]
    process = ServerProcess(args, api_key=API_KEY)
    yield process
    process.stop()


@pytest.fixture(scope="package")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with the default model's tokenizer, saved as an HF directory."""
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny_chat_model"))


@pytest.fixture(scope="package")
def tiny_chat_server(tiny_chat_model_dir: Path) -> Iterator[ServerProcess]:
    """`attnserve serve` on the tiny chat model, served as TINY_MODEL (CPU, no API key), with
    TINY_MAX_MODEL_LEN and TINY_MAX_BYTES as its limits."""
    args = [str(tiny_chat_model_dir), "--device", "cpu", "--served-model-name", TINY_MODEL]
    args += ["--max-model-len", str(TINY_MAX_MODEL_LEN)]
    process = ServerProcess([*args, "--max-request-bytes", str(TINY_MAX_BYTES)])
    yield process
    process.stop()
