"""`LoRAChecker`: the front end's check of each request's adapter, before the core sees it.

An adapter is read and checked (`peft.load_adapter`) the first time its id is seen; later
requests with the same `LoRARequest` pass at once. One id names one adapter: the same id under
another name or path is refused, as is any adapter while LoRA is off.
"""

from __future__ import annotations

from attnserve.lora.config import LoRAConfig
from attnserve.lora.peft import load_adapter
from attnserve.lora.request import LoRARequest
from attnserve.lora.targets import LoRATargets
from attnserve.model.config import ModelConfig


class LoRAChecker:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig | None) -> None:
        self.config = config
        self.targets = None if config is None else LoRATargets.of_model(model_config)
        self._checked: dict[int, LoRARequest] = {}

    def check(self, request: LoRARequest | None) -> None:
        """ValueError naming what is wrong with `request`'s adapter (None: the base model)."""
        if request is None:
            return
        if self.config is None or self.targets is None:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} requested, but LoRA is off "
                "(enable_lora=True, --enable-lora)"
            )
        known = self._checked.get(request.lora_int_id)
        if known == request:
            return
        if known is not None:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} "
                f"({known.lora_path}); {request.lora_name!r} needs an id of its own"
            )
        load_adapter(request, self.targets, self.config.max_lora_rank)
        self._checked[request.lora_int_id] = request

    def forget(self, adapter_id: int) -> None:
        """The adapter of `adapter_id` is gone (unloaded): its id may name another."""
        self._checked.pop(adapter_id, None)
