"""`attnserve bench kv-quality`: how far one KV-cache dtype, or one weight quantization, moves a
model's final hidden states and logits from another's (default: `--kv-cache-dtype fp8` against the
auto cache, bf16 on CUDA and float32 on the CPU; `--quantization fp8 --reference-quantization none`:
FP8 linear layers against the float ones), on the same weights (dummy weights are seeded), in one
process.

Two model runners, the reference and the measured one, run the same steps: one prefill of
`--num-prompts` random prompts of `--prompt-len` tokens, then `--decode-steps` decode steps, each
feeding every sequence the reference's greedy token (teacher forcing: both runs see the same
text). Reported, for the prefill and for the decodes apart (a prefill of prompts attends to its
own new K/V and reads nothing back from the cache; decodes read every key and value from it): the
relative errors of the final hidden states (after the last norm) and of the logits,
||ours - reference|| / ||reference|| over every position, and the share of positions whose top-1
tokens agree; and the fp8 cache's calibrated scales (`KVCacheScales`), smallest and largest over
its layers and heads. On the CPU a Triton-kernel backend runs under Triton's interpreter
(TRITON_INTERPRET=1): use a small model there.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from attnserve.attention import attention_layers
from attnserve.bench.common import check_output_files, progress, report
from attnserve.config import KV_CACHE_DTYPES, EngineArgs
from attnserve.model.quantization.resolve import QUANTIZATION_METHODS
from attnserve.step_types import NewSequence, StepPlan
from attnserve.worker.model_runner import ModelRunner
from attnserve.worker.worker import Worker

DEFAULT_CACHE_BYTES = 1 << 30
Step = tuple[torch.Tensor, torch.Tensor]  # a step's (final hidden states, logits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument(
        "--reference-kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="the reference run's KV cache (default: auto, the model's dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--reference-quantization", default=None, choices=list(QUANTIZATION_METHODS),
        help="the reference run's quantization (default: the measured run's --quantization)",
    )  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=8, help="sequences")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps after it")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def _runner(engine_args: EngineArgs) -> ModelRunner:
    worker = Worker(engine_args.create_engine_config(), 0, engine_args.resolved_device())
    worker.init_device()
    worker.load_model()
    return worker.runner


class _Sequences:
    """The prompts and their blocks (each sequence its own run of blocks), step by step: each
    step a plan of sequences new to the runner, whose cached tokens are already in the blocks
    (their ids do not matter: only the new tokens are read)."""

    def __init__(self, prompts: list[list[int]], total_len: int, block_size: int) -> None:
        per_seq = -(-total_len // block_size)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
        self.prompts = prompts

    def prefill(self) -> StepPlan:
        return self._plan(self.prompts, 0)

    def decode(self, tokens: list[int], context_len: int) -> StepPlan:
        return self._plan([[token] for token in tokens], context_len)

    def _plan(self, new_tokens: list[list[int]], context_len: int) -> StepPlan:
        seqs = [
            NewSequence(i, [0] * context_len + new, context_len + len(new), context_len, table)
            for i, (new, table) in enumerate(zip(new_tokens, self.tables, strict=True))
        ]
        return StepPlan.of_new(seqs)


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).norm() / theirs.norm())


def _compare(ours: list[Step], theirs: list[Step]) -> dict[str, float]:
    """Each step is (final hidden states, logits) of its new tokens, on the CPU in float32."""
    hidden, logits = (torch.cat(parts) for parts in zip(*ours, strict=True))
    ref_hidden, ref_logits = (torch.cat(parts) for parts in zip(*theirs, strict=True))
    return {
        "hidden_relative_error": _relative_error(hidden, ref_hidden),
        "logits_relative_error": _relative_error(logits, ref_logits),
        "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
        "positions": int(ref_logits.shape[0]),
    }


def _scales(runner: ModelRunner) -> dict[str, float]:
    layers = [layer.kv_scales for layer in attention_layers(runner.model) if layer.kv_scales]
    if not layers:
        return {}
    keys = torch.stack([s.k_scale for s in layers])
    values = torch.stack([s.v_scale for s in layers])
    return {
        "k_scale_min": float(keys.min()),
        "k_scale_max": float(keys.max()),
        "v_scale_min": float(values.min()),
        "v_scale_max": float(values.max()),
    }


def _step(runner: ModelRunner, plan: StepPlan) -> Step:
    """(final hidden states, logits) as float32 copies on the CPU (a graph's replay writes its
    output buffer again next step)."""
    hidden = runner.final_hidden_states(plan)
    logits = runner.model.compute_logits(hidden)
    return hidden.to("cpu", torch.float32, copy=True), logits.to("cpu", copy=True)


def _run(
    runner: ModelRunner, seqs: _Sequences, forced: list[list[int]] | None, steps: int
) -> tuple[list[Step], list[Step], list[list[int]]]:
    """(the prefill, each decode step, the tokens fed): `forced` tokens, else greedy ones."""
    prefill = _step(runner, seqs.prefill())
    ends = torch.tensor([len(p) for p in seqs.prompts]).cumsum(0) - 1
    last = prefill[1][ends]
    decodes, fed = [], []
    context = len(seqs.prompts[0])
    for step in range(steps):
        tokens = forced[step] if forced is not None else last.argmax(-1).tolist()
        fed.append(tokens)
        decodes.append(_step(runner, seqs.decode(tokens, context)))
        last = decodes[-1][1]
        context += 1
    return [prefill], decodes, fed


@dataclasses.dataclass
class ReferenceRun:
    """The reference's steps on the random prompts, and the greedy tokens it fed its decodes
    (which a measured run is fed in turn)."""

    seqs: _Sequences
    prefill: list[Step]
    decodes: list[Step]
    fed: list[list[int]]


def reference_run(
    engine_args: EngineArgs, num_prompts: int, prompt_len: int, decode_steps: int, seed: int
) -> ReferenceRun:
    """The reference runner's prefill of `num_prompts` random prompts and its greedy decodes."""
    reference = _runner(engine_args)
    vocab = reference.model_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab, (num_prompts, prompt_len), generator=generator)
    seqs = _Sequences(
        prompts.tolist(), prompt_len + decode_steps, reference.cache_config.block_size
    )
    prefill, decodes, fed = _run(reference, seqs, None, decode_steps)
    return ReferenceRun(seqs, prefill, decodes, fed)


def measured_run(
    engine_args: EngineArgs, reference: ReferenceRun
) -> tuple[ModelRunner, dict[str, float]]:
    """A runner of `engine_args` fed the reference's tokens, and its figures against the
    reference, prefill and decodes apart (`prefill_logits_relative_error`, ...)."""
    runner = _runner(engine_args)
    prefill, decodes, _ = _run(runner, reference.seqs, reference.fed, len(reference.fed))
    figures: dict[str, float] = {}
    for phase, ours, theirs in (
        ("prefill", prefill, reference.prefill),
        ("decode", decodes, reference.decodes),
    ):
        figures |= {f"{phase}_{key}": value for key, value in _compare(ours, theirs).items()}
    return runner, figures


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("num_prompts", "prompt_len", "decode_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_output_files(args, "json")
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory_bytes is None:
        engine_args = dataclasses.replace(engine_args, kv_cache_memory_bytes=DEFAULT_CACHE_BYTES)
    reference_quantization = args.reference_quantization or engine_args.quantization
    reference_args = dataclasses.replace(
        engine_args,
        kv_cache_dtype=args.reference_kv_cache_dtype,
        quantization=reference_quantization,
    )
    progress(
        f"reference run (kv cache {args.reference_kv_cache_dtype}, quantization "
        f"{reference_quantization or 'default'})"
    )
    reference = reference_run(
        reference_args, args.num_prompts, args.prompt_len, args.decode_steps, args.seed
    )
    progress(f"measured run (kv cache {engine_args.kv_cache_dtype})")
    runner, figures = measured_run(engine_args, reference)
    return {
        "model": runner.model_config.model,
        "backend": runner.backend.get_name(),
        "kv_cache_dtype": engine_args.kv_cache_dtype,
        "reference_kv_cache_dtype": args.reference_kv_cache_dtype,
        "quantization": runner.model_config.quantization or "none",
        "reference_quantization": reference_quantization or "none",
        "dtype": str(runner.model_config.dtype),
        **_scales(runner),
        **figures,
    }


def main(args: argparse.Namespace) -> int:
    return report(benchmark(args), args)
