"""Truncated or corrupt weight files are ValueErrors that name the file, never crashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve import LLM
from attnserve.model.default_model import embedded_gguf_path


def test_truncated_gguf(tmp_path: Path) -> None:
    data = embedded_gguf_path().read_bytes()
    for name, size in [("half.gguf", len(data) // 2), ("header.gguf", 1000)]:
        path = tmp_path / name
        path.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"{name}.*truncated or corrupt"):
            LLM(str(path), device="cpu")


def test_truncated_safetensors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for file in tiny_llama_dir.iterdir():
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            data = data[: len(data) // 2]
        (tmp_path / file.name).write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        LLM(str(tmp_path), device="cpu")
