"""Servers that several server test modules share, each started once and stopped after the last
test of this package: the default model (with an API key; no tool flags: tools in the server's
own format) and a tiny random Llama that carries the default model's tokenizer.

A module's tests ask for `server` (the default model's shared server unless the module defines
its own `server`: the tiny chat model's, or one started with the module's own flags), `client`
(the official client on that server) and `tokenizer` (the default model's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from attnserve.model.default_model import default_model_dir
from tests.conftest import HANG_GUARD_S
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


@pytest.fixture(scope="module")
def server(default_model_server: ServerProcess) -> ServerProcess:
    """The module's server: the default model's shared one (a module may define its own)."""
    return default_model_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official client on the module's `server`, with its API key if it has one; no
    retries."""
    api_key = server.api_key or "none"
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=HANG_GUARD_S
    )


@pytest.fixture(scope="package")
def tokenizer() -> Any:
    """The default model's tokenizer, through transformers."""
    return AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)
