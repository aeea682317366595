"""Hugging Face hub model ids (`org/name`) resolved to a local snapshot, as vLLM resolves them.

`resolve_model_path` hands back anything that is not shaped like a hub id, or that exists on
disk, unchanged; a hub id is downloaded with huggingface_hub's `snapshot_download` (its own
progress bars) into the hub cache (`download_dir`, else `HF_HUB_CACHE`, else `$HF_HOME/hub`,
read when called) — only the files the engine reads: configs, tokenizer files, the chat
template and the safetensors weights with their index (Python files too, with
`trust_remote_code`). `revision` picks a branch, tag or commit; `HF_TOKEN` authenticates;
`HF_HUB_OFFLINE=1` reads the cache only. An id that cannot be had is a ValueError naming it.
huggingface_hub is imported only when an id is resolved.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
IGNORE_PATTERNS = ["original/*", "consolidated*"]  # other formats of the same weights
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(model: str) -> bool:
    """Shaped like `org/name` and not a path on disk (nor a .gguf file name)."""
    if not _HUB_ID.fullmatch(model) or model.endswith(".gguf"):
        return False
    return not os.path.exists(model)


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set, read now (not at import)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_cache_dir(download_dir: str | None) -> str | None:
    """Where snapshots live: `download_dir`, `HF_HUB_CACHE`, `$HF_HOME/hub`, or None
    (huggingface_hub's default)."""
    if download_dir:
        return download_dir
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def resolve_model_path(
    model: str,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    what: str = "model",
) -> str:
    """`model` itself, or the local snapshot folder of the hub id `model` (see the module
    docstring); `what` names it in errors ("model", "tokenizer")."""
    if not is_hub_id(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = hub_offline()
    cache = hub_cache_dir(download_dir)
    patterns = [*ALLOW_PATTERNS, "*.py"] if trust_remote_code else ALLOW_PATTERNS
    if not offline:
        logger.info("fetching %s %s (revision %s) from the hub", what, model, revision or "main")
    try:
        path: str = snapshot_download(
            model,
            revision=revision,
            cache_dir=cache,
            allow_patterns=patterns,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as error:
        raise ValueError(_unavailable(model, revision, what, cache, error)) from None
    except (HfHubHTTPError, HFValidationError) as error:
        raise ValueError(
            f"{what} {model!r} is not a local path, and the Hugging Face hub does not give it "
            f"(revision {revision or 'main'}): {_first_line(error)} (a private or gated model "
            "needs HF_TOKEN)"
        ) from None
    return path


def _unavailable(
    model: str, revision: str | None, what: str, cache: str | None, error: Exception
) -> str:
    where = cache or "the default hub cache"
    if hub_offline():
        return (
            f"{what} {model!r} (revision {revision or 'main'}) is not a local path and is not "
            f"in the hub cache ({where}), and HF_HUB_OFFLINE is set: download it first "
            "(unset HF_HUB_OFFLINE) or give a local directory"
        )
    return (
        f"{what} {model!r} is not a local path, is not in the hub cache ({where}), and the hub "
        f"could not be reached: {_first_line(error)}"
    )


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
