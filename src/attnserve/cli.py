"""The `attnserve` command: one sub-command per job, each a thin call into the package."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from attnserve.attention.backends.abstract import AttentionSpec
from attnserve.attention.selector import backend_report, default_device


def _backends(args: argparse.Namespace) -> int:
    spec = AttentionSpec(
        head_size=args.head_size,
        dtype=getattr(torch, args.dtype),
        block_size=args.block_size,
        device=args.device or default_device(),
    )
    print(f"attention backends for {spec}:")
    for name, reasons in backend_report(spec).items():
        print(f"  {name:<16} {'ok' if not reasons else 'no: ' + '; '.join(reasons)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from attnserve.demo import run_attention_demo

    return run_attention_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list attention backends and whether they fit")
    backends.add_argument("--head-size", type=int, default=128)
    backends.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    backends.add_argument("--block-size", type=int, default=16)
    backends.add_argument("--device", default=None)
    backends.set_defaults(handler=_backends)
    demo = commands.add_parser("demo", help="run the quick-start demo")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
