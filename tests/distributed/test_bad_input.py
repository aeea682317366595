"""Bad tensor-parallel settings fail up front, with a ValueError naming the problem."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attnserve.cli import build_parser
from attnserve.engine.arg_utils import EngineArgs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
        ({"tensor_parallel_size": 3}, "does not divide its 4 attention heads"),
        ({"distributed_executor_backend": "mpi"}, "unknown distributed_executor_backend 'mpi'"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "'uni' runs one rank",
        ),
    ],
)
def test_bad_parallel_settings(settings: dict[str, object], message: str) -> None:
    args = EngineArgs(model="llama-tiny", load_format="dummy", device="cpu")
    args = dataclasses.replace(args, **settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_kv_heads_must_divide_or_be_divided(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=48,
        intermediate_size=96,
        num_attention_heads=12,
        num_key_value_heads=4,
    ).save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="its 4 KV heads"):
        dataclasses.replace(args, tensor_parallel_size=6).create_engine_config()
    # fewer KV heads than ranks is fine: each KV head is replicated
    config = dataclasses.replace(args, tensor_parallel_size=12).create_engine_config()
    assert config.parallel_config.executor_backend == "mp"


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["generate", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "x"]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.tensor_parallel_size == 2
    assert engine_args.distributed_executor_backend == "ray"
