"""`GrammarCache`: structured-output specs compiled by xgrammar, each distinct spec once.

Compiling takes milliseconds to tens of them, so it is kept off the engine's step: a spec is
compiled on the cache's own thread (xgrammar releases the GIL while it compiles) and every later
request with the same spec (`StructuredOutputsParams.key`) gets the same `Future`, done already:
an LRU of the last `max_entries` specs, failures included (a bad schema fails again at once).
A failure is a ValueError carrying the compiler's own message.

Compiled grammars do not pickle, so the front end (to refuse a bad spec at submission) and the
engine core (whose matchers use it) each compile: `grammar_cache` keeps one cache per model and
process, so with the core in the front end's process they share it and a spec is compiled once;
a core in a process of its own compiles each distinct spec once more, when its first request
arrives. In the core, the cache loads the model's tokenizer itself (the core has none otherwise).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import load_tokenizer
from attnserve.structured_outputs import StructuredOutputsParams, load_xgrammar

logger = logging.getLogger(__name__)

DEFAULT_MAX_GRAMMARS = 256
# xgrammar's messages start with a timestamp and the C++ source line: "[13:12:25] /x/y.cc:83: "
_COMPILER_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")

CompiledGrammar = Any  # xgrammar.CompiledGrammar (the package is optional)
GrammarMatcher = Any  # xgrammar.GrammarMatcher


def compiler_message(error: Exception) -> str:
    """The compiler's message without its timestamp and source location."""
    return _COMPILER_PREFIX.sub("", str(error).strip())


class GrammarCache:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_entries: int = DEFAULT_MAX_GRAMMARS,
    ) -> None:
        xgr = load_xgrammar()
        started = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        threads = min(8, os.cpu_count() or 1)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._matcher_class = xgr.GrammarMatcher
        batch_matcher = getattr(xgr, "BatchGrammarMatcher", None)  # xgrammar >= 0.1.25
        self._batch_filler = batch_matcher() if batch_matcher is not None else None
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="attnserve-grammar")
        self._entries: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        logger.info("grammar compiler ready in %.2f s", time.perf_counter() - started)

    def compile_async(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of `spec`: the cached future, or a compile started now."""
        key = spec.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._entries[key] = future
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec`, waiting for it; ValueError for a bad spec."""
        return self.compile_async(spec).result()

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher (at the grammar's start) of a compiled grammar."""
        return self._matcher_class(compiled)

    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask`: the tokens `matchers[i]` allows next (on xgrammar's threads
        where it has batch filling)."""
        if self._batch_filler is not None and len(matchers) > 1:
            self._batch_filler.batch_fill_next_token_bitmask(matchers, bitmask)
            return
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        compiler = self._compiler
        any_whitespace = spec.any_whitespace  # compact: xgrammar's separators ", " and ": "
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.key[1], any_whitespace=any_whitespace)
            if spec.kind == "json_object":  # any object: no schema to be strict about
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False
                )
            if spec.kind == "regex":
                return compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return compiler.compile_grammar(spec.ebnf_for_choice)
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(
                f"invalid structured_outputs.{spec.kind}: {compiler_message(error)}"
            ) from error


_caches: dict[tuple[str | None, int, tuple[int, ...]], GrammarCache] = {}
_caches_lock = threading.Lock()


def grammar_cache(model_config: ModelConfig, tokenizer: Any = None) -> GrammarCache:
    """This process's cache for the model, built on first use from `tokenizer` (loaded here if
    not given: the engine core has none) and xgrammar's view of its vocabulary; ValueError
    without a tokenizer or without xgrammar."""
    stop_token_ids = list(model_config.eos_token_ids)
    key = (model_config.tokenizer, model_config.vocab_size, tuple(stop_token_ids))
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            if model_config.tokenizer is None:
                raise ValueError(
                    "structured outputs need the model's tokenizer; it has none (dummy "
                    "weights): give one (`tokenizer=`, `--tokenizer`: an HF tokenizer directory "
                    "or a .gguf file whose vocabulary fits in the model's)"
                )
            load_xgrammar()  # the missing package named before the tokenizer is loaded
            if tokenizer is None:
                tokenizer = load_tokenizer(model_config)
            cache = _caches[key] = GrammarCache(tokenizer, model_config.vocab_size, stop_token_ids)
        return cache
