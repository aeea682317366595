"""`StructuredOutputsConfig` (vLLM's `structured_outputs_config`, attnserve's own keys): the bytes
of compiled grammars a process caches, the largest spec accepted and how long one may take to
compile."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """`cache_bytes`: compiled grammars each process keeps (their xgrammar sizes; least recently
    used first out); `max_spec_bytes`: the largest spec (its text: a schema's compact JSON)
    accepted; `compile_timeout_s`: how long the front end waits for a spec to compile before
    refusing it. The defaults let 50 distinct 400 KB specs (about 100 MB compiled each) through
    while raising neither process's memory by more than 500 MB."""

    cache_bytes: int = 64 << 20
    max_spec_bytes: int = 512 << 10
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "max_spec_bytes", "compile_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"structured_outputs_config.{name} must be a positive number")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> StructuredOutputsConfig:
        """The config of `--structured-outputs-config`'s JSON (None: the defaults); ValueError
        naming an unknown key."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values or {}) - set(known))
        if unknown:
            raise ValueError(
                f"structured_outputs_config: unknown key {unknown[0]!r} (known: {', '.join(known)})"
            )
        return cls(**(values or {}))
