"""`LoRAModelManager`: one rank's adapters — a `LoRALinear` on each target projection of the
model, `max_loras` device slots kept as an LRU, loaded from a host cache of `max_cpu_loras`
adapters (each read from its PEFT folder once), and every step's per-token slots.

The ranks learn each sequence's adapter from the plan (`NewSequence.lora_request`); before a
step runs, every adapter its sequences use is made resident (evicting the least recently used
slots no sequence of the step needs: the scheduler sends at most `max_loras` adapters a step)
and each new token gets its sequence's slot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from attnserve.lora.config import LoRAConfig
from attnserve.lora.layers import LoRAIndices, LoRALinear
from attnserve.lora.peft import LoRAAdapter, load_adapter
from attnserve.lora.request import LoRARequest
from attnserve.lora.targets import MERGED_LAYERS, LoRATargets
from attnserve.model.config import ModelConfig
from attnserve.model.layers.linear import Linear
from attnserve.step_types import AdapterRef, StepPlan

logger = logging.getLogger(__name__)
GRAPH_TOKENS_BOUND = 16384  # more tokens than a padded graph step carries (64 KiB of slots)


class LoRAModelManager:
    """The adapters of one rank's `model` (a decoder of the dense Llama family)."""

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        targets: LoRATargets,
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.config, self.targets = config, targets
        self.indices = LoRAIndices(max_tokens, device)
        dtype = next(model.parameters()).dtype
        shape = (config.max_loras, config.max_lora_rank)
        self.layers: list[dict[str, LoRALinear]] = []
        for decoder in model.get_submodule("model.layers").children():
            hooks = {}
            for name, (path, modules) in MERGED_LAYERS.items():
                base = decoder.get_submodule(path)
                if not isinstance(base, Linear):
                    raise ValueError(f"LoRA: {path} of {type(model).__name__} is not a linear")
                hooks[name] = base.lora = LoRALinear(base, modules, self.indices, shape, dtype)
            self.layers.append(hooks)
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.seq_adapters: dict[int, LoRARequest] = {}
        logger.info(
            "LoRA: %d slots of rank %d, %.1f MiB", config.max_loras, config.max_lora_rank,
            self.num_bytes / 2**20,
        )  # fmt: skip

    @classmethod
    def for_model(
        cls, model: nn.Module, config: LoRAConfig, model_config: ModelConfig, max_step_tokens: int
    ) -> LoRAModelManager:
        """The manager of a loaded `model` whose steps carry up to `max_step_tokens` tokens
        (room is left for graph padding and decode rows beyond them)."""
        device = next(model.parameters()).device
        max_tokens = max(max_step_tokens, GRAPH_TOKENS_BOUND)
        return cls(model, config, LoRATargets.of_model(model_config), max_tokens, device)

    @property
    def num_bytes(self) -> int:
        """The device memory of every slot of every projection."""
        return sum(hook.num_bytes for hooks in self.layers for hook in hooks.values())

    def prepare(self, plan: StepPlan) -> None:
        """Take in the plan's sequences and released ids, make the step's adapters resident
        and set each new token's slot."""
        for seq_id in plan.released_seq_ids:
            self.seq_adapters.pop(seq_id, None)
        for seq in plan.new_seqs:
            if seq.lora_request is not None:
                self.seq_adapters[seq.seq_id] = as_lora_request(seq.lora_request)
        requests = [self.seq_adapters.get(seq_id) for seq_id in plan.seq_ids]
        slots = self.activate({r.lora_int_id: r for r in requests if r is not None})
        per_seq = [-1 if r is None else slots[r.lora_int_id] for r in requests]
        self.indices.set(np.repeat(np.asarray(per_seq, np.int32), plan.num_new_tokens))

    def activate(self, requests: dict[int, LoRARequest]) -> dict[int, int]:
        """Each of `requests`' adapters in a slot (adapter id -> slot)."""
        if len(requests) > self.config.max_loras:
            raise RuntimeError(
                f"a step with {len(requests)} adapters; max_loras is {self.config.max_loras}"
            )
        for adapter_id in requests:
            if adapter_id in self.resident:
                self.resident.move_to_end(adapter_id)
        for adapter_id, request in requests.items():
            if adapter_id not in self.resident:
                self._load_slot(self._free_slot(requests), self.adapter(request))
        return {adapter_id: self.resident[adapter_id] for adapter_id in requests}

    def _free_slot(self, needed: dict[int, LoRARequest]) -> int:
        taken = set(self.resident.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in taken]
        if free:
            return free[0]
        victim = next(a for a in self.resident if a not in needed)
        return self.resident.pop(victim)

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, hooks in enumerate(self.layers):
            for hook in hooks.values():
                weights = {
                    part.module: adapter.weights[(layer, part.module)]
                    for part in hook.slices
                    if (layer, part.module) in adapter.weights
                }
                hook.set_slot(slot, weights, adapter.scaling)
        self.resident[adapter.int_id] = slot

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter from the host cache, read from its folder when not there."""
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.targets, self.config.max_lora_rank)
            if len(self.cpu_cache) >= self.config.cpu_capacity:
                self.cpu_cache.popitem(last=False)
            self.cpu_cache[request.lora_int_id] = adapter
        self.cpu_cache.move_to_end(request.lora_int_id)
        return adapter


def as_lora_request(ref: AdapterRef) -> LoRARequest:
    """The plan's adapter reference as a `LoRARequest`."""
    if isinstance(ref, LoRARequest):
        return ref
    return LoRARequest(ref.lora_name, ref.lora_int_id, ref.lora_path)
