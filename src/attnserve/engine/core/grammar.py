"""`GrammarCache`: structured-output specs compiled by xgrammar, each distinct spec once, in a
cache bounded by bytes.

Compiling takes milliseconds to seconds, so it is kept off the engine's step: a spec is compiled
on the cache's pool of `COMPILE_THREADS` threads (xgrammar releases the GIL while it compiles, so
a trivial spec never waits behind a slow one while a thread is free), and every later request
with the same spec (`StructuredOutputsParams.key`) gets the same `Future`, done already. The
cache keeps the compiled grammars of `StructuredOutputsConfig.cache_bytes` at most (xgrammar's
`memory_size_bytes` of each), least recently used first out; a grammar larger than that is used
by its requests and not kept. Failures are kept too (a bad schema fails again at once), as their
message only. A failure is a ValueError carrying the compiler's own message.

Compiled grammars do not pickle, so the front end (to refuse a bad spec at submission: `check`,
with the config's size limit and compile timeout) and the engine core (whose matchers use it:
`compile_async`) each compile: `grammar_cache` keeps one cache per model, config and process, so
with the core in the front end's process they share it and a spec is compiled once. A front end
without a core in its process (`mark_core_process` never called) keeps only each spec's verdict,
never its compiled grammar. In the core, the cache loads the model's tokenizer itself. A grammar
is freed once neither the cache nor a request holds it, but glibc keeps the pages of its many
small allocations (about 1.6 times its `memory_size_bytes`): after every `TRIM_AFTER_BYTES` of
grammars freed, a pool thread hands the heap's free pages back to the system (`malloc_trim`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.model.config import ModelConfig
from attnserve.model.tokenizer import load_tokenizer
from attnserve.output_constraints import (
    StructuredOutputsParams,
    build_grammar,
    compiler_message,
    load_xgrammar,
)

logger = logging.getLogger(__name__)

COMPILE_THREADS = 4  # specs compiled at once (each on xgrammar's threads too)
ENTRY_BYTES = 512  # what an entry costs besides its grammar: key digest, future, bookkeeping
TRIM_AFTER_BYTES = 32 << 20

CompiledGrammar = Any  # xgrammar.CompiledGrammar (the package is optional)
GrammarMatcher = Any  # xgrammar.GrammarMatcher


def _done(result: Any = None, error: BaseException | None = None) -> Future[Any]:
    """A future done already, with `result` or `error`."""
    future: Future[Any] = Future()
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
    return future


_CHECKED = _done()  # a spec a front end has seen compile, its grammar not kept


@dataclass
class _Entry:
    future: Future[CompiledGrammar]  # _CHECKED: compiled once, not kept
    keep: bool  # False: a front end's check, which keeps only the verdict
    nbytes: int


class GrammarCache:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        config: StructuredOutputsConfig | None = None,
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
        self.config = config or StructuredOutputsConfig()
        self.keeps_checked = False  # True where a core uses this cache: `check` keeps grammars
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="attnserve-grammar")
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.cached_bytes = 0
        self._freed_bytes = 0  # grammars freed since the heap was last trimmed
        self._trim_due = threading.Event()
        trim = _malloc_trim()
        if trim is not None:
            name = "attnserve-grammar-trim"
            threading.Thread(target=self._trim_heap, args=(trim,), name=name, daemon=True).start()
        self.hits = 0
        self.misses = 0
        logger.info("grammar compiler ready in %.2f s", time.perf_counter() - started)

    def compile_async(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of `spec`: the cached future, or a compile started now."""
        return self._lookup(spec, spec.key, keep=True)

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec`, waiting for it; ValueError for a bad spec."""
        return self.compile_async(spec).result()

    def check(self, spec: StructuredOutputsParams) -> None:
        """The front end's check of a request's spec: ValueError for one over the size limit,
        one the compiler refuses and one not compiled within the timeout (in a front end
        without a core, its compile is dropped if it has not started)."""
        config = self.config
        key = spec.key
        size = len(key[1].encode())
        if size > config.max_spec_bytes:
            raise ValueError(
                f"invalid structured_outputs.{spec.kind}: {size} bytes, over the "
                f"server's limit of {config.max_spec_bytes} (structured_outputs_config "
                "max_spec_bytes)"
            )
        future = self._lookup(spec, key, keep=self.keeps_checked)
        try:
            future.result(timeout=config.compile_timeout_s)
        except (TimeoutError, CancelledError):
            if not self.keeps_checked:  # only checks wait for it: not started, not needed
                future.cancel()
            raise ValueError(
                f"invalid structured_outputs.{spec.kind}: not compiled within "
                f"{config.compile_timeout_s:g} s (structured_outputs_config compile_timeout_s)"
            ) from None

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

    def _lookup(
        self, spec: StructuredOutputsParams, key: tuple[str, str, bool], keep: bool
    ) -> Future[CompiledGrammar]:
        """The entry's future (one only checked is compiled again where the grammar is to be
        kept), or a compile started now (its entry costs the spec's text until it ends)."""
        digest = _digest(key)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None and (entry.future is not _CHECKED or not keep):
                self._entries.move_to_end(digest)
                entry.keep = entry.keep or keep
                self.hits += 1
                return entry.future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            if entry is not None:
                self.cached_bytes -= entry.nbytes
            self._entries[digest] = entry = _Entry(future, keep, ENTRY_BYTES + len(key[1]))
            self._entries.move_to_end(digest)
            self.cached_bytes += entry.nbytes
        future.add_done_callback(functools.partial(self._settle, digest))
        return future

    def _settle(self, digest: bytes, future: Future[CompiledGrammar]) -> None:
        """A compile has ended: its entry (if still there) takes its size or its message, and
        the least recently used entries over the budget go."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None or entry.future is not future:
                return
            if future.cancelled():
                del self._entries[digest]
                self.cached_bytes -= entry.nbytes
                return
            error = future.exception()
            nbytes = ENTRY_BYTES
            if error is not None:  # a fresh error: the compile's frames (and spec) not kept
                entry.future = _done(error=ValueError(str(error)))
                nbytes += len(str(error))
            elif entry.keep:
                nbytes += future.result().memory_size_bytes
            else:
                entry.future = _CHECKED
            self.cached_bytes += nbytes - entry.nbytes
            entry.nbytes = nbytes
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used entries until the cache fits its budget."""
        while self.cached_bytes > self.config.cache_bytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            self.cached_bytes -= entry.nbytes

    def _freed(self, nbytes: int) -> None:
        """A compiled grammar is gone (in whichever thread let it go, whatever locks it
        holds: maybe the step's, maybe this cache's); past TRIM_AFTER_BYTES freed, the
        trimming thread is woken."""
        self._freed_bytes += nbytes  # under the GIL; a lost update only delays a trim
        if self._freed_bytes >= TRIM_AFTER_BYTES:
            self._freed_bytes = 0
            self._trim_due.set()

    def _trim_heap(self, trim: Callable[[int], int]) -> None:
        while True:
            self._trim_due.wait()
            self._trim_due.clear()
            trim(0)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        try:
            compiled = self._compiler.compile_grammar(build_grammar(spec))
        except (RuntimeError, ValueError, TypeError, RecursionError) as error:
            raise ValueError(
                f"invalid structured_outputs.{spec.kind}: {compiler_message(error)}"
            ) from None
        weakref.finalize(compiled, self._freed, compiled.memory_size_bytes).atexit = False
        return compiled


def _digest(key: tuple[str, str, bool]) -> bytes:
    """The cache's key of a spec: a digest of its key, not its (maybe large) text."""
    kind, text, any_whitespace = key
    return hashlib.sha256(f"{kind}\0{int(any_whitespace)}\0{text}".encode()).digest()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


CacheKey = tuple[str | None, int, tuple[int, ...], StructuredOutputsConfig]
_caches: dict[CacheKey, GrammarCache] = {}
_core_keys: set[CacheKey] = set()
_caches_lock = threading.Lock()


def _cache_key(model_config: ModelConfig, config: StructuredOutputsConfig | None) -> CacheKey:
    stop_token_ids = tuple(model_config.eos_token_ids)
    config = config or StructuredOutputsConfig()
    return model_config.tokenizer, model_config.vocab_size, stop_token_ids, config


def mark_core_process(
    model_config: ModelConfig, config: StructuredOutputsConfig | None = None
) -> None:
    """An engine core runs in this process: its cache keeps what the front end compiles."""
    key = _cache_key(model_config, config)
    with _caches_lock:
        _core_keys.add(key)
        if key in _caches:
            _caches[key].keeps_checked = True


def grammar_cache(
    model_config: ModelConfig,
    tokenizer: Any = None,
    config: StructuredOutputsConfig | None = None,
) -> GrammarCache:
    """This process's cache for the model and config, built on first use from `tokenizer`
    (loaded here if not given: the engine core has none) and xgrammar's view of its vocabulary;
    ValueError without a tokenizer or without xgrammar."""
    key = _cache_key(model_config, config)
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
            cache = GrammarCache(tokenizer, model_config.vocab_size, list(key[2]), key[3])
            cache.keeps_checked = key in _core_keys
            _caches[key] = cache
        return cache
