"""Multi-LoRA serving: PEFT adapters applied per request, many of them in one batch.

`LoRARequest` names a request's adapter; `LoRAConfig` the engine's limits; `peft` reads and
checks an adapter; the ranks keep adapters in device slots and add each row's adapter product to
the base projections.
"""

from attnserve.lora.config import LoRAConfig
from attnserve.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
