"""`LoRAConfig`: how many adapters an engine serves at once and how large they may be (vLLM's
names: `max_loras` resident on the device, `max_lora_rank`, `max_cpu_loras` cached on the host).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras` device slots (an LRU), adapters of rank up to `max_lora_rank`, up to
    `max_cpu_loras` adapters kept loaded on the host (None: `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded on the host."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
