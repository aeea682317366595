"""Data parallelism on one host: two engine-core processes behind one front end give the same
greedy tokens as one in-process core and both get requests; the balancer keeps a shared prefix
on the core that has it (unless that core is much busier) and spreads the rest by load; bad
sizes are ValueErrors up front."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.engine.arg_utils import EngineArgs
from attnserve.engine.dp_client import CoreBalancer, DPClient

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_two_cores_give_one_cores_greedy_tokens_and_share_the_work(tiny_llama_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 380) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    single = LLM(str(tiny_llama_dir), device="cpu")
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    single.shutdown()
    llm = LLM(str(tiny_llama_dir), device="cpu", data_parallel_size=2)
    try:
        client = llm.llm_engine.client
        assert isinstance(client, DPClient) and len(client.clients) == 2
        assert len({c.ready.pid for c in client.clients}) == 2
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == expected
        per_core = [s["num_requests_added"] for s in client.core_stats()]
        assert sum(per_core) == len(prompts) and min(per_core) > 0
        assert llm.llm_engine.stats()["kv_cache_usage"] == 0
        assert client.balancer.load == [0, 0]  # every request accounted for as finished
    finally:
        llm.shutdown()


def test_the_balancer_follows_prefixes_then_load() -> None:
    balancer = CoreBalancer(num_cores=2, block_size=4, prefix_caching=True)
    shared = list(range(100, 112))  # three full blocks
    balancer.assign("a", balancer.pick([*shared, 1]), [*shared, 1])
    assert balancer.load == [1, 0]
    assert balancer.pick([7, 8, 9, 10, 11]) == 1  # no known prefix: the least busy core
    assert balancer.pick([*shared, 2, 3]) == 0  # the core that holds the prefix
    for i in range(3):
        balancer.assign(f"s{i}", 0, [*shared, i])
    assert balancer.pick([*shared, 9]) == 1  # the prefix's core is too busy now
    balancer.release("a")
    balancer.release("unknown")  # nothing to release: no change
    assert balancer.load == [3, 0]
    plain = CoreBalancer(num_cores=3, block_size=4, prefix_caching=False)
    picks = []
    for i in range(6):
        picks.append(plain.pick(shared))
        plain.assign(str(i), picks[-1], shared)
    assert picks == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be a positive int"),
        ({"data_parallel_size": 1.5}, "data_parallel_size must be a positive int"),
        (
            {"data_parallel_size": 2, "engine_core_process": False},
            "engine_core_process cannot be off",
        ),
    ],
)
def test_bad_data_parallel_sizes_are_value_errors(
    kwargs: dict[str, object], message: str, tiny_llama_dir: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(str(tiny_llama_dir), device="cpu", **kwargs).create_engine_config()  # type: ignore[arg-type]


def test_data_parallel_needs_its_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs 4 GPUs; this host has 3"):
        args.create_parallel_config(torch.device("cuda"))
    with pytest.raises(ValueError, match="names one GPU"):
        EngineArgs(data_parallel_size=2).create_parallel_config(torch.device("cuda", 1))
    assert EngineArgs(data_parallel_size=3).create_parallel_config(torch.device("cuda"))
