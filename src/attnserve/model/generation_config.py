"""`--generation-config`: the model's generation_config.json as the default sampling fields.

As vLLM: "auto" reads the model's own file, "vllm" reads none (the engine's defaults), any other
value is a folder whose generation_config.json is read. Of the file, the sampling fields
(temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens) become
the defaults of requests that do not set them — the server's, and `LLM`'s
`get_default_sampling_params()` — and its `do_sample` is ignored, as vLLM ignores it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnserve.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")
GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_FIELDS = {  # generation_config.json's name -> SamplingParams'
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """The folder's generation_config.json ({} where it has none)."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a JSON file: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} holds {type(loaded).__name__}, not a JSON object")
    return loaded


def default_sampling_fields(generation_config: str, model_dir: str | None) -> dict[str, Any]:
    """The SamplingParams fields `generation_config` sets (vLLM's `get_diff_sampling_param`);
    checked here, so a bad file fails at start-up with a ValueError naming it."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        found = read_generation_config(model_dir) if model_dir else {}
        where = f"{model_dir}/{GENERATION_CONFIG_FILE}"
    else:
        if not (Path(generation_config) / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(
                f"generation_config {generation_config!r} is neither "
                f"{' nor '.join(GENERATION_CONFIG_MODES)} nor a folder with a "
                f"{GENERATION_CONFIG_FILE}"
            )
        found = read_generation_config(generation_config)
        where = f"{generation_config}/{GENERATION_CONFIG_FILE}"
    fields = {ours: found.get(theirs) for theirs, ours in SAMPLING_FIELDS.items()}
    fields = {name: value for name, value in fields.items() if value is not None}
    _check(fields, where)
    return fields


def _check(fields: dict[str, Any], where: str) -> None:
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: its sampling defaults are invalid: {error}") from None
