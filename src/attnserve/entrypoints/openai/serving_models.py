"""`OpenAIServingModels`: the models a server answers to (vLLM's class of that name) — the base
model and, with LoRA on, each adapter loaded under its own name (`--lora-modules` at start-up,
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` at run time). A request's `model`
picks the adapter; `/v1/models` lists the adapters with the base model as `parent`.

An adapter is checked when it is loaded (the engine's `LoRAChecker`: a bad one is a 400 naming
what is wrong) and gets a fresh `lora_int_id`, so an adapter loaded again under the same name
never reuses the old one's slots or cached prefixes. Metrics: requests per adapter
(`lora_requests_total`, by `lora_name`) and the adapters loaded (`lora_adapters_loaded`).
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.metrics import PREFIX
from attnserve.entrypoints.openai.protocol import ModelCard
from attnserve.lora.checker import LoRAChecker
from attnserve.lora.request import LoRAModulePath, LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class OpenAIServingModels:
    def __init__(
        self,
        base_model: str,
        max_model_len: int,
        checker: LoRAChecker | None = None,
        lora_modules: tuple[LoRAModulePath, ...] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        """`checker` None: LoRA off (adapters are refused); `registry`: the server's metrics."""
        self.requests = Counter(
            PREFIX + "lora_requests", "requests served per LoRA adapter", ["lora_name"],
            registry=registry,
        )  # fmt: skip
        loaded = Gauge(PREFIX + "lora_adapters_loaded", "LoRA adapters loaded", registry=registry)
        loaded.set_function(lambda: len(self.lora_requests))
        self.base_model = base_model
        self.max_model_len = max_model_len
        self.checker = checker
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for module in lora_modules:
            self.add_adapter(module.name, module.path)

    def cards(self) -> list[ModelCard]:
        """The base model's card, then each adapter's (its `parent` the base model)."""
        base = ModelCard(id=self.base_model, max_model_len=self.max_model_len)
        return [base] + [
            ModelCard(
                id=name, root=lora.lora_path, parent=self.base_model,
                max_model_len=self.max_model_len,
            )
            for name, lora in self.lora_requests.items()
        ]  # fmt: skip

    def card(self, model_id: str) -> ModelCard:
        for card in self.cards():
            if card.id == model_id:
                return card
        raise ApiError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")

    def check(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for no model."""
        if model is None or model == self.base_model:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise ApiError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return lora

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """`check`, counting the request under its adapter."""
        lora = self.check(model)
        if lora is not None:
            self.requests.labels(lora.lora_name).inc()
        return lora

    def add_adapter(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter (ValueError naming what is wrong)."""
        if self.checker is None:
            raise ValueError("LoRA is off: start the server with --enable-lora")
        if name == self.base_model or name in self.lora_requests:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        lora = LoRARequest(name, next(self._ids), path)
        self.checker.check(lora)
        self.lora_requests[name] = lora
        return lora

    def remove_adapter(self, name: str) -> None:
        lora = self.lora_requests.pop(name, None)
        if lora is None:
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name")
        if self.checker is not None:
            self.checker.forget(lora.lora_int_id)


def add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        try:  # the adapter is read and checked off the event loop
            await asyncio.to_thread(models.add_adapter, body.lora_name, body.lora_path)
        except ValueError as error:
            raise ApiError(400, str(error), "lora_name", "invalid_lora_adapter") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        models.remove_adapter(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
