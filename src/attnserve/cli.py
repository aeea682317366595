"""The `attnserve` command: generate, chat, serve, backends, cache, bench — thin calls into the
package."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeAlias

from attnserve.attention.abstract import AttentionSpec
from attnserve.attention.selector import (
    backend_report,
    describe_capabilities,
    get_attn_backend,
    registered_capabilities,
)
from attnserve.sampling_params import SamplingParams
from attnserve.version import __version__

if TYPE_CHECKING:
    from attnserve.model.model_cache import CacheEntry


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
    )


def _add_sampling_args(
    parser: argparse.ArgumentParser, temperature: float, max_tokens: int | None = 128
) -> None:
    limit = "default %(default)s" if max_tokens else "default: up to the model's context limit"
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"most tokens per answer ({limit})"
    )
    parser.add_argument(
        "--temperature", type=float, default=temperature, help="0 is greedy (default %(default)s)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="most likely tokens kept (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="least relative probability")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the draws")


def _generate(args: argparse.Namespace) -> int:
    from attnserve.config import EngineArgs
    from attnserve.entrypoints.llm import LLM

    if args.chat and args.prompt_token_ids:
        raise ValueError("--chat takes text prompts, not --prompt-token-ids")
    prompts: list[str] | list[list[int]] = (
        [_token_ids(p) for p in args.prompts] if args.prompt_token_ids else args.prompts
    )
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    started = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, _sampling(args), use_tqdm=False)
    else:
        outputs = llm.generate(prompts, _sampling(args), use_tqdm=False)
    elapsed = time.perf_counter() - started
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        answer = completion.text.strip() if llm.get_tokenizer() else completion.token_ids
        print(f"> {prompt}\n{answer}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s]")
    empty = any(not o.outputs[0].text.strip() for o in outputs)
    if empty and not args.chat and getattr(llm.get_tokenizer(), "chat_template", None):
        print(
            "attnserve: an empty answer: this is a chat model; --chat applies its chat template",
            file=sys.stderr,
        )
    return 0


def _token_ids(text: str) -> list[int]:
    """A --prompt-token-ids prompt: token ids separated by commas or spaces."""
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--prompt-token-ids: {text!r} is not a list of token ids (e.g. 5,6,7)")
    return [int(p) for p in parts]


def _chat(args: argparse.Namespace) -> int:
    from attnserve.config import EngineArgs
    from attnserve.engine.llm_engine import LLMEngine
    from attnserve.entrypoints.chat import chat_loop, line_editing

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    try:
        with line_editing() as read:
            chat_loop(engine, _sampling(args), _model_name(args), read, system=args.system)
    finally:
        engine.shutdown()
    return 0


def _model_name(args: argparse.Namespace) -> str:
    from attnserve.model.default_model import default_model_name

    return str(args.model) if args.model is not None else default_model_name()


def _serve(args: argparse.Namespace) -> int:
    _check_port_free(args.host, args.port)  # before the server module loads anything
    from attnserve.entrypoints.openai.api_server import run_server

    return run_server(args)


def _check_port_free(host: str, port: int) -> None:
    """ValueError unless `host`:`port` can be bound (as uvicorn binds it: SO_REUSEADDR)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def _backends(args: argparse.Namespace) -> int:
    spec = _backend_spec(args)
    print(f"attention backends for {spec}:")
    for name, reasons in backend_report([spec]).items():
        print(f"  {name:<16} {'can serve it' if not reasons else 'no: ' + '; '.join(reasons)}")
        if name in registered_capabilities():
            print(f"  {'':<16} {describe_capabilities(registered_capabilities()[name])}")
    chosen = get_attn_backend(spec)
    print(f"selected: {chosen.get_name()} (highest priority among those that can serve it)")
    return 0


def _backend_spec(args: argparse.Namespace) -> AttentionSpec:
    """The spec `attnserve backends` reports on: the flags', or the model's (default: the
    embedded model's) where not given."""
    from attnserve.config import EngineArgs
    from attnserve.model.config import ModelConfig, resolve_dtype
    from attnserve.model.default_model import default_model_dir

    device = EngineArgs(device=args.device).resolved_device().type
    model = args.model if args.model is not None else str(default_model_dir())
    config = ModelConfig.resolve(model, dtype=args.dtype, device=device)
    shape = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_size": config.head_size,
        "sliding_window": config.sliding_window,
    }
    given = {name: getattr(args, name) for name in shape if getattr(args, name, None) is not None}
    return AttentionSpec(
        **(shape | given),
        dtype=resolve_dtype(args.dtype, device),
        block_size=args.block_size,
        device=device,
    )


def _cache(args: argparse.Namespace) -> int:
    from attnserve.model.model_cache import cache_entries, cache_root, clear_cache

    root = cache_root()
    if args.cache_command == "clear":
        removed = clear_cache(root)
        print(f"removed {_count(removed)} ({_mb(removed)}) from {root}")
        return 0
    entries = cache_entries(root)
    print(f"{root}: {_count(entries)}, {_mb(entries)}")
    default = _default_model_entry()
    for entry in entries:
        note = "  (the default model)" if entry.path == default else ""
        note = note if entry.finished else "  (unfinished: a conversion running or killed)"
        print(f"  {entry.size_bytes / 1e6:9.1f} MB  {entry.path.name}{note}")
    return 0


def _default_model_entry() -> Path | None:
    """The default model's cache path (converted or not), or None without its package."""
    from attnserve.model.default_model import converted_dir, embedded_gguf_path

    try:
        return converted_dir(embedded_gguf_path())
    except ValueError:
        return None


def _count(entries: Sequence[CacheEntry]) -> str:
    return f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"


def _mb(entries: Sequence[CacheEntry]) -> str:
    return f"{sum(e.size_bytes for e in entries) / 1e6:.1f} MB"


def _engine_parser(
    commands: Commands,
    name: str,
    help_text: str,
    positional_model: bool = False,
) -> argparse.ArgumentParser:
    from attnserve.config import EngineArgs

    parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
    EngineArgs.add_cli_args(parser, positional_model)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (the full usage is one --help away); its
    subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


Commands: TypeAlias = "argparse._SubParsersAction[_Parser]"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"attnserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = _engine_parser(commands, "generate", "generate text for prompts")
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to answer")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument(
        "--prompt-token-ids",
        action="store_true",
        help="each PROMPT is token ids (5,6,7): for a model without a tokenizer (a dummy preset)",
    )
    _add_sampling_args(generate, temperature=0.0)
    generate.set_defaults(handler=_generate)
    chat = _engine_parser(commands, "chat", "chat with a model in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, temperature=0.7, max_tokens=None)
    chat.set_defaults(handler=_chat)
    from attnserve.config import FrontendArgs

    serve = _engine_parser(commands, "serve", "OpenAI-compatible server (loopback)", True)
    FrontendArgs.add_cli_args(serve)
    serve.set_defaults(handler=_serve)
    _add_backends_command(commands)
    _add_cache_command(commands)
    _add_bench_commands(commands)
    for leaf in _leaf_parsers(parser):
        leaf.add_argument(
            "--log-level",
            default="warning",
            choices=LOG_LEVELS,
            help="attnserve's log level (default %(default)s)",
        )
    return parser


LOG_LEVELS = ["debug", "info", "warning", "error"]


def _add_backends_command(commands: Commands) -> None:
    backends = commands.add_parser("backends", help="list attention backends and whether they fit")
    backends.add_argument(
        "--model", default=None,
        help="take the attention shape from this model's config (default: the embedded model)",
    )  # fmt: skip
    for flag, what in [
        ("--num-heads", "query heads per layer"),
        ("--num-kv-heads", "key/value heads per layer"),
        ("--head-size", "attention head size"),
    ]:
        backends.add_argument(flag, type=int, default=None, help=f"{what} (default: the model's)")
    backends.add_argument(
        "--dtype", default="auto", help="query and KV dtype (auto: bfloat16 on CUDA, else float32)"
    )
    backends.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    backends.add_argument("--device", default="auto", help="cpu or cuda (default: CUDA if any)")
    backends.set_defaults(handler=_backends)


def _add_cache_command(commands: Commands) -> None:
    cache = commands.add_parser("cache", help="the converted-model cache (~/.cache/attnserve)")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    actions.add_parser("list", help="what the cache holds, and its size")
    actions.add_parser("clear", help="remove everything it holds (converted again when used)")
    cache.set_defaults(handler=_cache)


BENCHMARKS = {
    "throughput": ("attnserve.bench.throughput", "offline generation throughput vs baselines"),
    "latency": ("attnserve.bench.latency", "one batch's prefill time, time per output token"),
    "speculative": (
        "attnserve.bench.speculative",
        "speculative decoding against none on repeat/edit prompts: speed-up, acceptance",
    ),
    "kernels": ("attnserve.bench.kernels", "attention kernels' decode/prefill speed (GPU)"),
    "moe": ("attnserve.bench.moe", "the fused-MoE kernel at decode batch sizes vs ceilings (GPU)"),
    "serve": ("attnserve.bench.serve", "a running server's throughput, TTFT, TPOT, ITL, latency"),
    "structured": ("attnserve.bench.structured", "grammar compile time, cache, mask"),
    "quality": (
        "attnserve.bench.quality",
        "a quantization's greedy tokens against a reference run",
    ),
    "kv-quality": (
        "attnserve.bench.kv_quality",
        "a KV-cache dtype's logits against another's (fp8 against auto) on the same weights",
    ),
    "kv-memory": (
        "attnserve.bench.kv_memory",
        "the KV memory one sequence holds at a long context (sliding-window blocks freed or not)",
    ),
    "llamacpp": ("attnserve.bench.llamacpp", "single-stream chat decode against llama.cpp (CPU)"),
    "families": (
        "attnserve.bench.families",
        "every preset family's standard workload and batch-1/8 latency against their bounds",
    ),
    "backends": (
        "attnserve.bench.backends",
        "each attention backend's end-to-end tok/s and attention share on each workload kind",
    ),
}


def _add_bench_commands(
    commands: Commands,
) -> None:
    """`attnserve bench NAME`: each benchmark module adds its own arguments and handler."""
    bench = commands.add_parser("bench", help="benchmarks")
    names = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        importlib.import_module(module).add_arguments(names.add_parser(name, help=help_text))


def _leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers of the commands that run something (those without subcommands)."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield parser
    for group in groups:
        for subparser in group.choices.values():
            yield from _leaf_parsers(subparser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; a user's mistake is one line on stderr and exit code 2. Output cut short
    by its reader (`| head`) ends the command quietly."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        print(
            f"attnserve: error: unrecognized argument {argv[0]}: a command comes first "
            "(see attnserve --help)",
            file=sys.stderr,
        )
        return 2
    try:
        return _run(build_parser().parse_args(argv))
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", force=True
    )
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ValueError as error:
        print(f"attnserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
