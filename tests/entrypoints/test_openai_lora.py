"""LoRA adapters behind the OpenAI-compatible server, driven by the official client: adapters
from `--lora-modules` (both `name=path` and vLLM's JSON form) listed in /v1/models with the base
model as parent, a request's `model` picking its adapter (greedy text equal to HF transformers'
on the weights with that adapter merged in), adapters loaded and unloaded at run time with
OpenAI-style errors, and requests counted per adapter in /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import HANG_GUARD_S, TINY_LLAMA, hf_greedy
from tests.entrypoints.openai_server import TINY_MODEL, ServerProcess
from tests.lora.adapters import write_merged_model, write_peft_adapter

PROMPT = [11, 502, 77, 3000, 9, 41, 1234]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server_adapters")
    return {
        "a": write_peft_adapter(root / "a", TINY_LLAMA, rank=8, seed=5),
        "b": write_peft_adapter(
            root / "b", TINY_LLAMA, rank=4, seed=6, modules=("q_proj", "o_proj")
        ),
        "c": write_peft_adapter(root / "c", TINY_LLAMA, rank=2, seed=7),
        "big": write_peft_adapter(root / "big", TINY_LLAMA, rank=16, seed=8),
    }  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    args = [str(tiny_chat_model_dir), "--device", "cpu", "--served-model-name", TINY_MODEL]
    args += ["--max-model-len", "128", "--enable-lora", "--max-loras", "2"]
    args += ["--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}"]
    args += [json.dumps({"name": "b", "path": str(adapters["b"])})]
    process = ServerProcess(args)
    yield process
    process.stop()


def _post(server: ServerProcess, route: str, body: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=HANG_GUARD_S)


def test_models_list_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) >= {TINY_MODEL, "a", "b"}
    assert cards["a"].parent == cards["b"].parent == TINY_MODEL  # type: ignore[attr-defined]
    assert getattr(cards[TINY_MODEL], "parent", None) is None
    assert client.models.retrieve("b").id == "b"


@pytest.mark.parametrize("name", [TINY_MODEL, "a", "b"])
def test_the_request_model_picks_the_adapter(
    client: openai.OpenAI,
    tiny_chat_model_dir: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
    name: str,
) -> None:
    weights = tiny_chat_model_dir
    if name in adapters:
        weights = write_merged_model(tiny_chat_model_dir, adapters[name], tmp_path / "merged")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    expected = tokenizer.decode(hf_greedy(weights, PROMPT, NEW_TOKENS), skip_special_tokens=True)
    reply = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.choices[0].text == expected
    assert reply.model == name  # as vLLM: the adapter's name


def test_adapters_load_and_unload_at_run_time(
    server: ServerProcess, client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    loaded = _post(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert loaded.status_code == 200, loaded.text
    assert "c" in {card.id for card in client.models.list().data}
    reply = client.completions.create(model="c", prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    again = _post(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    big = _post(
        server, "load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])}
    )
    assert big.status_code == 400 and "max_lora_rank (8)" in big.json()["error"]["message"]
    missing = _post(server, "load_lora_adapter", {"lora_name": "m", "lora_path": "/nonexistent"})
    assert (
        missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    )
    assert _post(server, "unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    gone = _post(server, "unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)


def test_requests_are_counted_per_adapter(server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.metrics().get('attnserve:lora_requests_total{lora_name="a"}', 0.0)
    client.completions.create(model="a", prompt=PROMPT, max_tokens=1)
    metrics = server.metrics()
    assert metrics['attnserve:lora_requests_total{lora_name="a"}'] == before + 1
    assert metrics["attnserve:lora_adapters_loaded"] >= 2
