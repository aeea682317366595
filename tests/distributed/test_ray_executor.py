"""The Ray executor on a local Ray instance with two CPU workers: the same greedy tokens as one
rank in-process; shutting down kills the actors and frees the placement group; a cluster too
small for the ranks is a ValueError, whether the executor or the caller started Ray."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from attnserve import LLM, SamplingParams
from tests.conftest import wait_until

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(10, 50)), [300, 2, 77]]
ENGINE: dict[str, Any] = {"model": "llama-tiny", "load_format": "dummy", "device": "cpu"}


def test_too_small_a_cluster_it_started_itself_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ray.is_initialized():
        pytest.skip("Ray is already running in this process")
    # the executor starts (and, on failing, stops) Ray itself: here with 2 CPUs on any machine
    monkeypatch.setattr(ray, "init", functools.partial(ray.init, num_cpus=2, log_to_driver=False))
    with pytest.raises(ValueError, match=r"needs 4 CPUs in the Ray cluster; it has 2$"):
        LLM(**ENGINE, tensor_parallel_size=4, distributed_executor_backend="ray")
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def generate(**engine: Any) -> list[list[int]]:
    llm = LLM(**ENGINE, **engine)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_ray_tp2_matches_one_rank(local_ray: None) -> None:
    expected = generate()
    assert generate(tensor_parallel_size=2, distributed_executor_backend="ray") == expected
    # Ray releases the actors' and bundles' CPUs lazily
    wait_until(lambda: ray.available_resources().get("CPU") == 2, "Ray to free both CPUs")


def test_too_few_cluster_resources_is_a_value_error(local_ray: None) -> None:
    with pytest.raises(ValueError, match="needs 4 CPUs in the Ray cluster; it has 2"):
        LLM(**ENGINE, tensor_parallel_size=4, distributed_executor_backend="ray")
