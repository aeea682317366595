"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields); `LoRAModulePath`,
an adapter the server loads at start-up (`--lora-modules`).

A leaf of the LoRA package: the front end, the engine core and the ranks pass it along with a
request; the ranks load the adapter from `lora_path` and key their slots by `lora_int_id`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter saved under `lora_path`, served as `lora_name`; `lora_int_id` (at least 1)
    identifies it in the engine: two requests with the same id share one loaded adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    @property
    def adapter_id(self) -> int:
        """The engine's key for this adapter (vLLM's `adapter_id`)."""
        return self.lora_int_id


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter the server loads at start-up (`--lora-modules name=path`, vLLM's name)."""

    name: str
    path: str


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`; ValueError otherwise."""
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({error})") from None
        if not isinstance(fields, dict) or not all(
            isinstance(fields.get(key), str) and fields[key] for key in ("name", "path")
        ):
            raise ValueError(f'--lora-modules {text!r}: needs {{"name": ..., "path": ...}}')
        return LoRAModulePath(fields["name"], fields["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: use name=path or a JSON object")
    return LoRAModulePath(name, path)
