"""The `attnserve` command: generate, chat, serve, bench, backends — thin calls into the package."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence

import torch

from attnserve.attention.backends.abstract import AttentionSpec
from attnserve.attention.selector import (
    backend_report,
    default_device,
    describe_capabilities,
    get_attn_backend,
    registered_capabilities,
)
from attnserve.sampling_params import SamplingParams


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
    )


def _add_sampling_args(parser: argparse.ArgumentParser, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    parser.add_argument(
        "--temperature", type=float, default=temperature, help="0 is greedy (default %(default)s)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="most likely tokens kept (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="least relative probability")
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the draws")


def _generate(args: argparse.Namespace) -> int:
    from attnserve.engine.arg_utils import EngineArgs
    from attnserve.entrypoints.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    started = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, _sampling(args), use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, _sampling(args), use_tqdm=False)
    elapsed = time.perf_counter() - started
    for prompt, output in zip(args.prompts, outputs, strict=True):
        print(f"> {prompt}\n{output.outputs[0].text.strip()}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s]")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from attnserve.engine.arg_utils import EngineArgs
    from attnserve.engine.llm_engine import LLMEngine
    from attnserve.entrypoints.chat import chat_loop

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    chat_loop(engine, _sampling(args), sys.stdin, system=args.system)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from attnserve.entrypoints.openai.api_server import run_server

    return run_server(args)


def _backends(args: argparse.Namespace) -> int:
    spec = AttentionSpec(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype=getattr(torch, args.dtype),
        block_size=args.block_size,
        device=args.device or default_device(),
    )
    print(f"attention backends for {spec}:")
    for name, reasons in backend_report([spec]).items():
        print(f"  {name:<16} {'can serve it' if not reasons else 'no: ' + '; '.join(reasons)}")
        if name in registered_capabilities():
            print(f"  {'':<16} {describe_capabilities(registered_capabilities()[name])}")
    chosen = get_attn_backend(spec)
    print(f"selected: {chosen.get_name()} (highest priority among those that can serve it)")
    return 0


def _engine_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_text: str,
    positional_model: bool = True,
) -> argparse.ArgumentParser:
    from attnserve.engine.arg_utils import EngineArgs

    parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
    EngineArgs.add_cli_args(parser, positional_model)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = _engine_parser(commands, "generate", "generate text for prompts", False)
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompts to answer")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    _add_sampling_args(generate, temperature=0.0)
    generate.set_defaults(handler=_generate)
    chat = _engine_parser(commands, "chat", "chat with a model in the terminal", False)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, temperature=0.7)
    chat.set_defaults(handler=_chat)
    from attnserve.entrypoints.openai.cli_args import add_server_args

    serve = _engine_parser(commands, "serve", "OpenAI-compatible server (loopback)")
    add_server_args(serve)
    serve.set_defaults(handler=_serve)
    backends = commands.add_parser("backends", help="list attention backends and whether they fit")
    backends.add_argument("--num-heads", type=int, default=32, help="query heads per layer")
    backends.add_argument("--num-kv-heads", type=int, default=8, help="key/value heads per layer")
    backends.add_argument("--head-size", type=int, default=128, help="attention head size")
    backends.add_argument(
        "--dtype",
        default="bfloat16" if torch.cuda.is_available() else "float32",
        help="query and KV dtype",
    )
    backends.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    backends.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if any)")
    backends.set_defaults(handler=_backends)
    _add_bench_commands(commands)
    return parser


BENCHMARKS = {
    "throughput": ("attnserve.bench.throughput", "offline generation throughput vs baselines"),
    "latency": ("attnserve.bench.latency", "one batch's prefill time, time per output token"),
    "kernels": ("attnserve.bench.kernels", "attention kernels' decode/prefill speed (GPU)"),
    "serve": ("attnserve.bench.serve", "a running server's throughput, TTFT, TPOT, ITL, latency"),
}


def _add_bench_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """`attnserve bench NAME`: each benchmark module adds its own arguments and handler."""
    bench = commands.add_parser("bench", help="benchmarks")
    names = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        importlib.import_module(module).add_arguments(names.add_parser(name, help=help_text))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ValueError as error:
        print(f"attnserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
