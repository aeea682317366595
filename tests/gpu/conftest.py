"""Fixtures of the GPU tests: the HF reference, built once per dtype, and GPU memory handed back
between tests."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.gpu.reference import Reference, build_reference


@pytest.fixture(scope="session")
def hf_reference() -> Callable[[str], Reference]:
    """`hf_reference(dtype)`: the Reference in "float32" or "bfloat16", built once."""
    built: dict[str, Reference] = {}

    def get(dtype: str) -> Reference:
        if dtype not in built:
            built[dtype] = build_reference(dtype)
        return built[dtype]

    return get


@pytest.fixture(autouse=True)
def free_gpu_memory() -> Iterator[None]:
    """Each test's engines are gone, and their memory back, before the next test starts."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
