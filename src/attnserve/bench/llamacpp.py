"""`attnserve bench llamacpp`: single-stream chat decode against llama.cpp (llama-cpp-python) on
the same GGUF file, in one run, turn by turn.

Each of `--num-iters` rounds times attnserve and then llama.cpp on the same request: the chat
template around `--prompt`, `--output-len` greedy tokens (attnserve `ignore_eos`; llama.cpp with
the end-of-sequence token's logit biased away), tokens / wall time of the whole call (prompt
included), after one warm-up each. llama.cpp runs in a subprocess of `--llama-cpp-python` (an
interpreter that has llama_cpp; default: this one), `--threads` threads (attnserve: torch's
threads, the same number), loading the file once per round outside the timed call. Reported:
each round's two figures and ratio, and their medians, minima and maxima (a shared machine's
load moves both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from attnserve.bench.common import check_output_files, check_positive, progress, report
from attnserve.config import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.model.default_model import embedded_gguf_path
from attnserve.sampling_params import SamplingParams

PROMPT = "Write a short story about a robot learning to paint."

# Run by the llama.cpp interpreter: argv = path, threads, prompt, output_len; prints one JSON.
_LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, threads, prompt, output_len = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
messages = [{"role": "user", "content": prompt}]
no_eos = {llm.token_eos(): -1e9}
llm.create_chat_completion(messages, max_tokens=8, temperature=0.0, logit_bias=no_eos)
started = time.perf_counter()
out = llm.create_chat_completion(
    messages, max_tokens=output_len, temperature=0.0, logit_bias=no_eos
)
seconds = time.perf_counter() - started
usage = out["usage"]
print(json.dumps({"seconds": seconds, "tokens": usage["completion_tokens"],
                  "prompt_tokens": usage["prompt_tokens"]}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--prompt", default=PROMPT, help="the user message")
    parser.add_argument("--output-len", type=int, default=128, help="greedy tokens per call")
    parser.add_argument("--num-iters", type=int, default=3, help="rounds (each times both)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    parser.add_argument(
        "--llama-cpp-python", default=sys.executable, metavar="PYTHON",
        help="an interpreter with llama_cpp (llama-cpp-python) installed (default: this one)",
    )  # fmt: skip
    parser.add_argument("--no-llama-cpp", action="store_true", help="time attnserve alone")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def _check(args: argparse.Namespace) -> None:
    check_positive(args, "output_len", "num_iters", "threads")
    check_output_files(args, "json")
    if args.model is not None and not str(args.model).endswith(".gguf") and not args.no_llama_cpp:
        raise ValueError("llama.cpp needs a .gguf --model (or the default model); --no-llama-cpp")
    if not args.no_llama_cpp:
        probe = [args.llama_cpp_python, "-c", "import llama_cpp"]
        if subprocess.run(probe, capture_output=True).returncode != 0:
            raise ValueError(
                f"{args.llama_cpp_python} cannot import llama_cpp: pip install "
                "llama-cpp-python there, point --llama-cpp-python at such an interpreter, or "
                "use --no-llama-cpp"
            )


def _time_attnserve(llm: LLM, args: argparse.Namespace) -> float:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    messages = [{"role": "user", "content": args.prompt}]
    started = time.perf_counter()
    (output,) = llm.chat(messages, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return len(output.outputs[0].token_ids) / seconds


def _time_llama_cpp(path: str, args: argparse.Namespace) -> float:
    command = [args.llama_cpp_python, "-c", _LLAMA_CPP, path, str(args.threads), args.prompt,
               str(args.output_len)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp failed ({done.returncode}): {done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return float(figures["tokens"]) / float(figures["seconds"])


def _summary(name: str, values: list[float]) -> dict[str, float]:
    return {
        f"{name}_median": statistics.median(values),
        f"{name}_min": min(values),
        f"{name}_max": max(values),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    torch.set_num_threads(args.threads)
    path = str(args.model) if args.model is not None else str(embedded_gguf_path())
    progress("loading attnserve")
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    progress("warm-up")
    _time_attnserve(llm, args)
    ours, theirs = [], []
    for round_ in range(args.num_iters):
        progress(f"round {round_ + 1} of {args.num_iters}")
        ours.append(_time_attnserve(llm, args))
        if not args.no_llama_cpp:
            theirs.append(_time_llama_cpp(path, args))
    result: dict[str, Any] = {
        "model": llm.llm_engine.model_config.model,
        "quantization": llm.llm_engine.model_config.quantization or "none",
        "threads": args.threads,
        "output_len": args.output_len,
        "attnserve_tok_s": ours,
        **_summary("attnserve_tok_s", ours),
    }
    llm.shutdown()
    if theirs:
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        result |= {"llama_cpp_tok_s": theirs, **_summary("llama_cpp_tok_s", theirs)}
        result |= {"ratio": ratios, **_summary("ratio", ratios)}
    return result


def main(args: argparse.Namespace) -> int:
    result = benchmark(args)
    report(result, args)
    for key in ("attnserve_tok_s", "llama_cpp_tok_s", "ratio"):
        if key in result:
            print(f"{key} per round: " + ", ".join(f"{v:.2f}" for v in result[key]))
    return 0
