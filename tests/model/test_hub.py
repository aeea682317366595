"""Hub model ids resolved offline from a hub cache the test writes (`tests.hub_cache`), and
`--generation-config`'s defaults in `LLM` — against the tiny random Llama."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from attnserve.engine.arg_utils import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.model.config import HubOptions, ModelConfig
from attnserve.sampling_params import SamplingParams
from tests.hub_cache import COMMIT_A, COMMIT_B, add_snapshot

REPO = "test-org/tiny-llama"
GENERATION = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 4, "do_sample": True}
PROMPT = [1, 5, 9, 13]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """REPO at COMMIT_A (main; generation_config.json with GENERATION) and COMMIT_B (branch
    "short": max_position_embeddings 64)."""
    cache = tmp_path_factory.mktemp("hub")
    main = add_snapshot(cache, REPO, tiny_llama_dir, COMMIT_A)
    (main / "generation_config.json").write_text(json.dumps(GENERATION))
    short = add_snapshot(cache, REPO, tiny_llama_dir, COMMIT_B, refs=("short",))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def test_hub_id_resolves_to_the_main_snapshot(offline: Path) -> None:
    config = ModelConfig.resolve(REPO)
    assert Path(config.model) == offline / "models--test-org--tiny-llama/snapshots" / COMMIT_A
    assert config.max_model_len == 512
    assert config.get_diff_sampling_param() == {"temperature": 0.0, "top_k": 5, "max_tokens": 4}


@pytest.mark.parametrize("revision", [COMMIT_B, "short"])
def test_revision_picks_the_snapshot(offline: Path, revision: str) -> None:
    config = ModelConfig.resolve(REPO, hub=HubOptions(revision=revision))
    assert Path(config.model).name == COMMIT_B
    assert config.max_model_len == 64


def test_a_missing_id_offline_is_named(offline: Path) -> None:
    with pytest.raises(
        ValueError, match=r"'test-org/absent'.*not in the hub cache.*HF_HUB_OFFLINE"
    ):
        ModelConfig.resolve("test-org/absent")
    with pytest.raises(ValueError, match=f"{REPO!r} \\(revision {'c' * 40}\\) is not a local"):
        ModelConfig.resolve(REPO, hub=HubOptions(revision="c" * 40))


def test_a_tokenizer_id_resolves_the_same_way(offline: Path, tiny_llama_dir: Path) -> None:
    hub = HubOptions(revision=COMMIT_A, tokenizer_revision="short")
    config = ModelConfig.resolve(str(tiny_llama_dir), tokenizer=REPO, hub=hub)
    assert config.tokenizer is not None and Path(config.tokenizer).name == COMMIT_B
    with pytest.raises(ValueError, match="tokenizer 'test-org/no-tokenizer'"):
        ModelConfig.resolve(REPO, tokenizer="test-org/no-tokenizer")


def test_download_dir_is_the_cache(monkeypatch: pytest.MonkeyPatch, hub_cache: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache / "elsewhere"))
    config = ModelConfig.resolve(REPO, hub=HubOptions(download_dir=str(hub_cache)))
    assert Path(config.model).name == COMMIT_A


def test_generation_config_modes(offline: Path, tmp_path: Path, tiny_llama_dir: Path) -> None:
    assert ModelConfig.resolve(REPO, generation_config="vllm").get_diff_sampling_param() == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    folder = ModelConfig.resolve(REPO, generation_config=str(tmp_path))
    assert folder.get_diff_sampling_param() == {"top_p": 0.5}
    with pytest.raises(ValueError, match="neither auto nor vllm nor a folder"):
        ModelConfig.resolve(REPO, generation_config=str(tiny_llama_dir / "absent"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"sampling defaults are invalid.*top_p"):
        ModelConfig.resolve(REPO, generation_config=str(tmp_path))


def test_llm_on_a_hub_id_generates_like_the_directory(offline: Path, tiny_llama_dir: Path) -> None:
    by_id = LLM(REPO, device="cpu", max_model_len=64)
    assert by_id.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_k=5, max_tokens=4
    )
    ids = by_id.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids
    by_id.shutdown()
    by_dir = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, generation_config="vllm")
    assert by_dir.get_default_sampling_params() == SamplingParams()
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    assert by_dir.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids == ids
    by_dir.shutdown()
    assert len(ids) == 4


def test_trust_remote_code_reaches_transformers(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path
) -> None:
    from transformers import AutoConfig

    seen: list[object] = []
    load = AutoConfig.from_pretrained

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("trust_remote_code"))
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", recording)
    config = ModelConfig.resolve(str(tiny_llama_dir), hub=HubOptions(trust_remote_code=True))
    assert config.trust_remote_code and seen == [True]
    ModelConfig.resolve(str(tiny_llama_dir))
    assert seen == [True, False]


def test_the_flags_have_vllms_names() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, positional_model=True)
    flags = ["org/name", "--revision", "v1", "--tokenizer-revision", "v2", "--download-dir", "/d"]
    args = EngineArgs.from_cli_args(
        parser.parse_args([*flags, "--trust-remote-code", "--generation-config", "vllm"])
    )
    assert (args.model, args.revision, args.tokenizer_revision, args.download_dir) == (
        "org/name",
        "v1",
        "v2",
        "/d",
    )
    assert args.trust_remote_code and args.generation_config == "vllm"
    defaults = EngineArgs()
    assert not defaults.trust_remote_code and defaults.generation_config == "auto"
