"""`GrammarCache`'s bounds, on the default model's tokenizer (no model): the cache holds at most
its budget of compiled bytes (least recently used out, a grammar over the whole budget not kept),
a front end without a core keeps only verdicts, a spec past the size limit or the compile timeout
is refused naming the limit, and specs compile in parallel (a trivial one finishes while others
are held mid-compile). Also the spec's own checks: a schema nested too deeply, the config's keys.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.engine.core.grammar import ENTRY_BYTES, GrammarCache
from attnserve.model.default_model import default_model_dir
from attnserve.output_constraints import (
    MAX_SCHEMA_DEPTH,
    StructuredOutputsParams,
)
from tests.conftest import HANG_GUARD_S, wait_until

SLOW_REGEX = r"[\s\S]{0,300000}"  # about a second to compile on one core


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)


def new_cache(tokenizer: Any, keeps_checked: bool = True, **config: Any) -> GrammarCache:
    cache = GrammarCache(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], StructuredOutputsConfig(**config)
    )
    cache.keeps_checked = keeps_checked
    return cache


def schema(tag: int) -> StructuredOutputsParams:
    words = [f"w{tag}-{i}" for i in range(20)]
    return StructuredOutputsParams(
        json={"type": "object", "properties": {"v": {"type": "string", "enum": words}}}
    )


def settled(cache: GrammarCache, nbytes: int) -> None:
    """Wait for the compiles' callbacks (they run after the waiters wake) to bring the cache
    to `nbytes`."""
    wait_until(lambda: cache.cached_bytes == nbytes, f"{nbytes} cached bytes")


def test_the_cache_holds_its_budget_of_bytes_least_recently_used_out(tokenizer: Any) -> None:
    cache = new_cache(tokenizer)
    sizes = []
    for tag in range(3):
        before = cache.cached_bytes
        compiled = cache.compile(schema(tag))
        sizes.append(ENTRY_BYTES + compiled.memory_size_bytes)
        settled(cache, before + sizes[-1])
    cache.config = StructuredOutputsConfig(cache_bytes=sum(sizes) - 1)
    cache.compile(schema(1))  # the oldest now: 0
    fourth = cache.compile_async(schema(3))
    fourth.result(timeout=HANG_GUARD_S)
    wait_until(lambda: cache.cached_bytes <= cache.config.cache_bytes, "an eviction")
    misses = cache.misses
    assert cache.compile_async(schema(3)) is fourth  # kept
    cache.compile(schema(1))
    assert cache.misses == misses
    cache.compile(schema(0))  # evicted: compiled again
    assert cache.misses == misses + 1


def test_a_grammar_over_the_whole_budget_is_used_not_kept(tokenizer: Any) -> None:
    cache = new_cache(tokenizer, cache_bytes=1 << 20)
    spec = StructuredOutputsParams(regex=r"[a-z]{0,1000}")  # a few MB compiled
    assert cache.compile(spec).memory_size_bytes > 1 << 20
    settled(cache, 0)
    cache.compile(spec)
    assert cache.misses == 2


def test_a_front_end_without_a_core_keeps_only_verdicts(tokenizer: Any) -> None:
    cache = new_cache(tokenizer, keeps_checked=False)
    cache.check(schema(0))
    settled(cache, ENTRY_BYTES)
    cache.check(schema(0))
    bad = StructuredOutputsParams(json={"type": "objec"})
    for _ in range(2):
        with pytest.raises(ValueError, match=r"invalid structured_outputs\.json: Unsupported type"):
            cache.check(bad)
    assert (cache.hits, cache.misses) == (2, 2)
    cache.compile(schema(0))  # a core's use compiles what the check did not keep
    assert cache.misses == 3


def test_a_spec_past_the_size_limit_or_the_compile_timeout_is_refused(tokenizer: Any) -> None:
    cache = new_cache(tokenizer, keeps_checked=False, max_spec_bytes=64, compile_timeout_s=1e-3)
    with pytest.raises(ValueError, match=r"structured_outputs.regex: 65 bytes, over .* of 64"):
        cache.check(StructuredOutputsParams(regex="a" * 65))
    with pytest.raises(ValueError, match=r"structured_outputs.regex: not compiled within 0.001 s"):
        cache.check(StructuredOutputsParams(regex=SLOW_REGEX))


class _HeldCompiler:
    """xgrammar's compiler, but a grammar whose text has `marker` waits for `release`."""

    def __init__(self, compiler: Any, marker: str) -> None:
        self.compiler = compiler
        self.marker = marker
        self.release = threading.Event()
        self.held = threading.Semaphore(0)

    def compile_grammar(self, grammar: Any) -> Any:
        if self.marker in str(grammar):
            self.held.release()
            self.release.wait(HANG_GUARD_S)
        return self.compiler.compile_grammar(grammar)


@pytest.fixture
def held_cache(tokenizer: Any) -> Iterator[tuple[GrammarCache, _HeldCompiler]]:
    cache = new_cache(tokenizer)
    held = _HeldCompiler(cache._compiler, "held")
    cache._compiler = held
    yield cache, held
    held.release.set()


def test_a_trivial_spec_compiles_while_slow_ones_are_compiling(
    held_cache: tuple[GrammarCache, _HeldCompiler],
) -> None:
    cache, held = held_cache
    held_specs = [StructuredOutputsParams(grammar=f'root ::= "held{i}" [a-z]*') for i in range(2)]
    slow = [cache.compile_async(spec) for spec in held_specs]
    for _ in slow:
        assert held.held.acquire(timeout=HANG_GUARD_S)  # both mid-compile
    choice = cache.compile_async(StructuredOutputsParams(choice=["yes", "no"]))
    assert cache.matcher(choice.result(timeout=HANG_GUARD_S)).accept_string("yes")
    assert not any(future.done() for future in slow)
    held.release.set()
    for future in slow:
        future.result(timeout=HANG_GUARD_S)


def nested(levels: int) -> dict[str, Any]:
    """A schema of `levels` objects nested (arrays of arrays of ... strings)."""
    value: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        value = {"type": "array", "items": value}
    return value


def test_a_schema_nested_too_deeply_is_refused() -> None:
    StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH))
    for deep in (nested(MAX_SCHEMA_DEPTH + 1), json.dumps(nested(MAX_SCHEMA_DEPTH + 1))):
        with pytest.raises(ValueError, match=f"more than {MAX_SCHEMA_DEPTH} levels deep"):
            StructuredOutputsParams(json=deep)
    too_deep_to_parse = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="levels deep"):
        StructuredOutputsParams(json='{"a": ' + too_deep_to_parse + "}")


def test_the_config_refuses_unknown_keys_and_non_positive_limits() -> None:
    assert StructuredOutputsConfig.from_dict(None) == StructuredOutputsConfig()
    assert StructuredOutputsConfig.from_dict({"cache_bytes": 1}).cache_bytes == 1
    with pytest.raises(ValueError, match="unknown key 'backend'"):
        StructuredOutputsConfig.from_dict({"backend": "xgrammar"})
    with pytest.raises(ValueError, match="compile_timeout_s must be a positive number"):
        StructuredOutputsConfig.from_dict({"compile_timeout_s": 0})
