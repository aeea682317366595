"""The config package: the flags `EngineArgs` and `FrontendArgs` become parse back to the
dataclasses' own defaults and values, `KVCacheInfo` refuses what no cache can be, and the engine
core's block pools are the KV cache its rank allocated (blocks counted here by hand from the
model's shape and the fixed budget)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from attnserve.config import EngineArgs, FrontendArgs, KVCacheInfo
from attnserve.engine.core.engine_core import EngineCore
from tests.conftest import TINY_LLAMA


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, positional_model=True)
    FrontendArgs.add_cli_args(parser)
    return parser


def test_no_flags_give_the_dataclass_defaults() -> None:
    args = _serve_parser().parse_args([])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert FrontendArgs.from_cli_args(args) == FrontendArgs()


def test_each_kind_of_flag_reaches_its_field() -> None:
    args = _serve_parser().parse_args(
        [
            "m",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "64",
            "--speculative-config",
            '{"num_speculative_tokens": 3}',
            "--allow-no-api-key",
            "--shutdown-timeout",
            "2.5",
            "--reasoning-parser",
            "qwen3",
        ]
    )
    engine, frontend = EngineArgs.from_cli_args(args), FrontendArgs.from_cli_args(args)
    assert (engine.model, engine.block_size, engine.max_model_len) == ("m", 32, 64)
    assert engine.enable_prefix_caching is False
    assert engine.speculative_config == {"num_speculative_tokens": 3}
    assert frontend.allow_no_api_key is True
    assert (frontend.shutdown_timeout, frontend.reasoning_parser) == (2.5, "qwen3")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_blocks": 0, "num_swap_blocks": 0, "windows": (None,)}, "num_blocks"),
        ({"num_blocks": 4, "num_swap_blocks": -1, "windows": (None,)}, "num_swap_blocks"),
        ({"num_blocks": 4, "num_swap_blocks": 0, "windows": ()}, "windows"),
    ],
)
def test_kv_cache_info_names_the_bad_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        KVCacheInfo(**fields)  # type: ignore[arg-type]


def test_the_engine_core_pools_are_the_cache_its_rank_allocated(tiny_llama_dir: Path) -> None:
    head_size = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
    per_block = (  # K and V, every layer, fp32
        2 * TINY_LLAMA["num_hidden_layers"] * 16 * TINY_LLAMA["num_key_value_heads"] * head_size * 4
    )
    args = EngineArgs(
        model=str(tiny_llama_dir),
        device="cpu",
        max_model_len=64,
        kv_cache_memory_bytes=40 * per_block + 100,
        preemption_mode="swap",
        swap_space_bytes=7 * per_block,
        enforce_eager=True,
    )
    core = EngineCore(args.create_engine_config())
    try:
        assert core.executor.kv_cache_info == KVCacheInfo(40, 7, (None,))
        assert core.allocator.num_blocks == 40
        assert core.scheduler.swap_allocator is not None
        assert core.scheduler.swap_allocator.num_blocks == 7
    finally:
        core.shutdown()
