"""`EngineArgs.with_offline_defaults` / `with_server_defaults`: vLLM's larger offline and online
step limits on GPUs of 70 GiB or more, short steps for the CPU server, given limits kept;
`create_engine_config` fills the rest."""

from __future__ import annotations

import types

import pytest
import torch

from attnserve.engine.arg_utils import EngineArgs


def _on_gpu(monkeypatch: pytest.MonkeyPatch, gib: int) -> None:
    """Pretend the arguments resolve to a CUDA device of `gib` GiB."""
    monkeypatch.setattr(EngineArgs, "resolved_device", lambda self: torch.device("cuda"))
    props = types.SimpleNamespace(total_memory=gib * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def test_large_gpu_takes_vllms_offline_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_gpu(monkeypatch, 141)
    args = EngineArgs(model="llama-tiny").with_offline_defaults()
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (1024, 16384)
    given = EngineArgs(model="llama-tiny", max_num_seqs=8).with_offline_defaults()
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 16384)


def test_small_gpu_and_cpu_keep_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineArgs(model="llama-tiny", device="cpu").with_offline_defaults()
    scheduler = config.create_engine_config().scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 8192)
    _on_gpu(monkeypatch, 40)
    args = EngineArgs(model="llama-tiny").with_offline_defaults()
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (None, None)


def test_large_gpu_server_takes_vllms_online_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_gpu(monkeypatch, 141)
    args = EngineArgs(model="llama-tiny").with_server_defaults()
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (1024, 8192)
    given = EngineArgs(model="llama-tiny", max_num_batched_tokens=2048).with_server_defaults()
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (1024, 2048)
    _on_gpu(monkeypatch, 40)
    small = EngineArgs(model="llama-tiny").with_server_defaults()
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (None, None)


def test_cpu_server_takes_short_steps() -> None:
    args = EngineArgs(model="llama-tiny", device="cpu").with_server_defaults()
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (None, 128)
    given = EngineArgs(model="llama-tiny", device="cpu", max_num_batched_tokens=1024)
    assert given.with_server_defaults().max_num_batched_tokens == 1024
