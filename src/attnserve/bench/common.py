"""Helpers the offline benchmarks share: workloads of random token ids, timing `generate`, stage
lines on stderr, checking where results go before a run, printing / writing a result, and
parsing lists of counts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnserve.entrypoints.llm import LLM
from attnserve.lora.request import LoRARequest
from attnserve.sampling_params import SamplingParams, StructuredOutputsParams
from attnserve.spec_decode.metrics import SPEC_DECODE_COUNTS, spec_decode_stats


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    lora_requests: list[LoRARequest] | None = None  # each request's adapter (`bench/lora.py`)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def input_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]


def sampling_params(
    workload: Workload, structured: StructuredOutputsParams | None = None
) -> list[SamplingParams]:
    """Greedy, `ignore_eos`, exactly each request's output length (with `structured`, at most:
    a request also ends where its grammar does)."""
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=structured)
        for n in workload.output_lens
    ]


def timed_generate(
    llm: LLM, workload: Workload, structured: StructuredOutputsParams | None = None
) -> tuple[float, int]:
    """Seconds for one `generate` of the whole workload (greedy, ignore_eos), and the output
    tokens it made."""
    params = sampling_params(workload, structured)
    sync()
    started = time.perf_counter()
    outputs = llm.generate(
        workload.prompts, params, use_tqdm=False, lora_request=workload.lora_requests
    )
    sync()
    seconds = time.perf_counter() - started
    return seconds, sum(len(c.token_ids) for out in outputs for c in out.outputs)


def run_engine(llm: LLM, workload: Workload) -> float:
    """Seconds for one `generate` of the whole workload (greedy, ignore_eos)."""
    return timed_generate(llm, workload)[0]


def spec_decode_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Speculative decoding over a timed run, from the engine's stats before and after it
    (`spec_decode_stats` of the differences); {} without speculation."""
    if SPEC_DECODE_COUNTS[0] not in after:
        return {}
    return spec_decode_stats(*(after[key] - before[key] for key in SPEC_DECODE_COUNTS))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(message: str) -> None:
    """Stage lines on stderr, so a run cut short by a time limit shows where it was."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def check_output_files(args: argparse.Namespace, *flags: str) -> None:
    """ValueError unless each given output file's directory exists (checked before the run,
    not after it)."""
    for flag in flags:
        path = getattr(args, flag)
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"--{flag}: the directory of {path!r} does not exist")


def check_positive(args: argparse.Namespace, *flags: str) -> None:
    """ValueError naming the first of these integer flags that is below 1."""
    for flag in flags:
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def print_scalars(result: dict[str, Any]) -> None:
    """One `key  value` line per scalar entry (nested entries are printed by their owners)."""
    scalars = {k: v for k, v in result.items() if not isinstance(v, dict | list)}
    width = max(map(len, scalars))
    for key, value in scalars.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")


def write_json(path: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    """The result plus the command's arguments."""
    arguments = {k: v for k, v in vars(args).items() if k != "handler"}
    with open(path, "w") as handle:
        json.dump(result | {"args": arguments}, handle, indent=2, default=str)


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the result's scalars and, with `--json`, write it there; the exit status (0)."""
    print_scalars(result)
    if args.json:
        write_json(args.json, result, args)
    return 0


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, like 16,64,256."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 16,64,256: {text!r}")
    return values
