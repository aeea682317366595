"""`attnserve serve org/name` offline from a hub cache the test writes (`tests.hub_cache`):
served under the hub id, with the snapshot's generation_config.json as the defaults of the
requests that omit its fields (`--generation-config auto`), and a missing id refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from attnserve.cli import main
from tests.entrypoints.openai_server import ServerProcess
from tests.hub_cache import COMMIT_A, add_snapshot

REPO = "test-org/tiny-llama"
GENERATION = {"temperature": 0.0, "max_new_tokens": 3}
PROMPT = [1, 5, 9, 13]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    snapshot = add_snapshot(cache, REPO, tiny_llama_dir, COMMIT_A)
    (snapshot / "generation_config.json").write_text(json.dumps(GENERATION))
    return cache


@pytest.fixture(scope="module")
def hub_server(hub_cache: Path) -> Iterator[ServerProcess]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(hub_cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        args = ["--device", "cpu", "--max-model-len", "64", "--kv-cache-memory-bytes", "4194304"]
        process = ServerProcess([REPO, *args])
    yield process
    process.stop()


def _complete(server: ServerProcess, **fields: object) -> dict[str, object]:
    body = {"prompt": PROMPT, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result: dict[str, object] = response.json()
    return result


def _tokens(result: dict[str, object]) -> list[list[str]]:
    choices = result["choices"]
    assert isinstance(choices, list)
    return [choice["logprobs"]["tokens"] for choice in choices]


def test_served_under_the_hub_id(hub_server: ServerProcess) -> None:
    models = httpx.get(f"{hub_server.url}/v1/models", timeout=60).json()
    assert [card["id"] for card in models["data"]] == [REPO]
    assert _complete(hub_server, model=REPO, max_tokens=2)["model"] == REPO


def test_generation_config_defaults_fill_omitted_fields(hub_server: ServerProcess) -> None:
    defaulted = _complete(hub_server, logprobs=0)  # temperature 0, 3 tokens: the model's
    assert defaulted["usage"]["completion_tokens"] == 3  # type: ignore[index]
    greedy = _complete(hub_server, logprobs=0, temperature=0.0, max_tokens=3)
    assert _tokens(defaulted) == _tokens(greedy)


def test_request_fields_override_the_defaults(hub_server: ServerProcess) -> None:
    longer = _complete(hub_server, max_tokens=6)
    assert longer["usage"]["completion_tokens"] == 6  # type: ignore[index]
    sampled = _complete(hub_server, logprobs=0, temperature=1.0, n=4, seed=0, max_tokens=6)
    assert len({tuple(tokens) for tokens in _tokens(sampled)}) > 1  # not all greedy


def test_a_missing_hub_id_is_refused_by_name(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["serve", "test-org/absent", "--device", "cpu"]) == 2
    stderr = capsys.readouterr().err
    assert "model 'test-org/absent' (revision main) is not a local path" in stderr
    assert "neither an existing HF directory" not in stderr
