"""`attnserve bench structured`: what structured outputs cost before the first token, on the CPU.

Through the engine's own `GrammarCache` for the model's tokenizer (the default model's unless
`--model`): the one-off set-up (xgrammar's view of the vocabulary), the compile time of
`--repeats` distinct JSON schemas of `--fields` fields each (a cache miss every time: the field
names differ), and what a second request with a schema already seen pays (a cache hit). Also the
time to fill the token bitmask of `--batch` sequences at the schema's start (paid on the host
before every step with constrained draws).
Prints medians; `--json FILE` writes them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from attnserve.bench.common import progress, report
from attnserve.config import EngineArgs
from attnserve.engine.core.grammar import GrammarCache
from attnserve.engine.core.sequence_grammar import SequenceGrammar, token_bitmask
from attnserve.model.tokenizer import load_tokenizer
from attnserve.output_constraints import StructuredOutputsParams

_TYPES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "string", "enum": ["red", "green", "blue"]},
]


def schema(num_fields: int, tag: int) -> dict[str, Any]:
    """An object of `num_fields` required fields of mixed types, their names carrying `tag`."""
    names = [f"field_{tag}_{i}" for i in range(num_fields)]
    properties = {name: _TYPES[i % len(_TYPES)] for i, name in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names}


def _ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def _timed(work: Any) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.fields, args.repeats, args.batch) < 1:
        raise ValueError("--fields, --repeats and --batch must be >= 1")
    config = EngineArgs.from_cli_args(args).create_engine_config().model_config
    progress(f"loading the tokenizer of {config.model}")
    tokenizer = load_tokenizer(config)
    started = time.perf_counter()
    cache = GrammarCache(tokenizer, config.vocab_size, list(config.eos_token_ids))
    setup = time.perf_counter() - started
    schemas = [schema(args.fields, tag) for tag in range(args.repeats)]
    specs = [StructuredOutputsParams(json=s) for s in schemas]
    progress(f"compiling {len(specs)} distinct {args.fields}-field schemas")
    misses = [_timed(lambda spec=spec: cache.compile(spec)) for spec in specs]
    again = [StructuredOutputsParams(json=dict(s)) for s in schemas]  # equal specs, new objects
    hits = [_timed(lambda spec=spec: cache.compile(spec)) for spec in again]
    compiled = cache.compile(specs[0])
    batch = [SequenceGrammar(cache, compiled) for _ in range(args.batch)]
    fills = [_timed(lambda: token_bitmask(batch)) for _ in range(args.repeats)]
    return {
        "model": config.model,
        "vocab_size": config.vocab_size,
        "fields": args.fields,
        "schemas": len(specs),
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms_median": _ms(misses),
        "compile_ms_max": max(misses) * 1e3,
        "cached_compile_ms_median": _ms(hits),
        "cache_misses": cache.misses,
        "cache_hits": cache.hits,
        "bitmask_batch": args.batch,
        "bitmask_fill_ms_median": _ms(fills),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--fields", type=int, default=20, help="fields of each JSON schema")
    parser.add_argument("--repeats", type=int, default=10, help="distinct schemas compiled")
    parser.add_argument("--batch", type=int, default=64, help="sequences of one bitmask fill")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
