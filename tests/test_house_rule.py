"""The seed's rule: nothing outside attention/backends/, the registry and the selector names a
concrete backend or branches on a backend's name or KV layout."""

from __future__ import annotations

import re
from pathlib import Path

import attnserve

PACKAGE = Path(attnserve.__file__).parent
ALLOWED = (
    "attention/abstract.py",  # the contract: it declares the KV-layout hooks the backends fill
    "attention/backends/",
    "attention/ops/",
    "attention/registry.py",
    "attention/selector.py",
)
BACKEND_WORDS = re.compile(
    # TRITON (the backend) is matched in capitals only: the Triton language itself is fair game
    r"flashinfer|torch_sdpa|TorchSDPA|flex_attention|(?-i:\bTRITON\b)|backends\.triton|"
    r"TritonBackend|FLASH_ATTN|get_name\(\)\s*==|"
    r"get_kv_cache_block_dim|kv_cache\.shape\[",
    re.IGNORECASE,
)


def offending_lines() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BACKEND_WORDS.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_backend_names_outside_the_backend_layer() -> None:
    assert offending_lines() == []


def test_the_check_sees_a_leak(tmp_path: Path) -> None:
    assert BACKEND_WORDS.search("if backend.get_name() == 'TRITON':")
    assert BACKEND_WORDS.search("from attnserve.attention.backends.torch_sdpa import X")
    assert BACKEND_WORDS.search("from attnserve.attention.backends.triton import TritonBackend")
    assert not BACKEND_WORDS.search("import triton.language as tl")
