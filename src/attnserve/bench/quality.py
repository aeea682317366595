"""`attnserve bench quality`: a quantization's greedy tokens against a reference run of the
same model (by default its dequantized run, `--reference-quantization none`), in one process.

Per prompt (the model's chat template around fixed questions, or random token ids for a model
without a tokenizer): `--max-tokens` greedy tokens from each engine (`ignore_eos`); equal, or the
first step where they part, the two tokens, and the reference's log-probability gap between its
token and the quantized run's there (from its top `TOP_LOGPROBS`: "> gap" when the quantized
token is not among them). Then both engines (prefix caching off) score the same text (prompt +
the reference's tokens) token by token: the share of positions where their top-1 tokens agree,
and the mean and largest |difference| of the log-probability they give the text's next token.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from typing import Any

from attnserve.bench.common import check_output_files, progress, report
from attnserve.config import EngineArgs
from attnserve.entrypoints.llm import LLM
from attnserve.model.quantization.resolve import QUANTIZATION_METHODS
from attnserve.outputs import Logprob
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import TokenLogprobs

TOP_LOGPROBS = 5
QUESTIONS = [
    "What is the capital of France?",
    "Write a short story about a robot learning to paint.",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23?",
    "Write a haiku about the sea.",
    "How do vaccines work?",
    "Translate 'good morning' into Spanish and German.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument(
        "--reference-quantization", default="none", choices=list(QUANTIZATION_METHODS),
        help="the reference run's quantization (default: none, dequantized)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=len(QUESTIONS), help="prompts")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures")
    parser.set_defaults(handler=main)


def _prompts(llm: LLM, count: int, seed: int) -> list[list[int]]:
    tokenizer = llm.llm_engine.tokenizer
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        rng = random.Random(seed)
        vocab = llm.llm_engine.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(rng.randint(8, 64))] for _ in range(count)]
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats
    ]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _scores(llm: LLM, texts: list[list[int]]) -> list[list[TokenLogprobs]]:
    """Each text's per-position log-probabilities (the next token's and the top one's)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(texts, params, use_tqdm=False)
    return [[values(row or {}) for row in (o.prompt_logprobs or [])[1:]] for o in outputs]


def values(entry: dict[int, Logprob]) -> TokenLogprobs:
    """One position's log-probabilities as plain floats."""
    return {token: logprob.logprob for token, logprob in entry.items()}


def _parting(quantized: Any, reference: Any) -> dict[str, Any]:
    """Where the quantized run's tokens part from the reference's, and the reference's gap."""
    ours, theirs = list(quantized.token_ids), list(reference.token_ids)
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if step is None:
        return {"equal": True}
    top = values(reference.logprobs[step])
    own = top[theirs[step]]
    gap = own - top[ours[step]] if ours[step] in top else own - min(top.values())
    return {
        "equal": False,
        "first_difference": step,
        "reference_token": theirs[step],
        "quantized_token": ours[step],
        "logprob_gap": gap,
        "gap_is_lower_bound": ours[step] not in top,
    }


def _agreement(quantized: list[list[TokenLogprobs]], reference: list[list[TokenLogprobs]],
               texts: list[list[int]]) -> dict[str, float]:  # fmt: skip
    agree, gaps = [], []
    for ours, theirs, text in zip(quantized, reference, texts, strict=True):
        for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            agree.append(max(a, key=a.__getitem__) == max(b, key=b.__getitem__))
            target = text[position + 1]
            gaps.append(abs(a[target] - b[target]))
    return {
        "top1_agreement": sum(agree) / len(agree),
        "mean_abs_logprob_diff": statistics.fmean(gaps),
        "max_abs_logprob_diff": max(gaps),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--max-tokens and --num-prompts must be >= 1")
    check_output_files(args, "json")
    # prompt log-probabilities come only for the tokens a step computes: no prefix cache
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), enable_prefix_caching=False)
    reference_args = dataclasses.replace(engine_args, quantization=args.reference_quantization)
    progress(f"quantized run ({engine_args.quantization or 'the checkpoint default'})")
    llm = LLM.from_engine_args(engine_args)
    prompts = _prompts(llm, args.num_prompts, args.seed)
    ours = _greedy(llm, prompts, args.max_tokens)
    quantization = llm.llm_engine.model_config.quantization
    progress(f"reference run ({args.reference_quantization})")
    reference_llm = LLM.from_engine_args(reference_args)
    theirs = _greedy(reference_llm, prompts, args.max_tokens)
    texts = [p + list(t.token_ids) for p, t in zip(prompts, theirs, strict=True)]
    progress("scoring the reference's text with both")
    agreement = _agreement(_scores(llm, texts), _scores(reference_llm, texts), texts)
    llm.shutdown()
    reference_llm.shutdown()
    partings = [_parting(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {
        "model": llm.llm_engine.model_config.model,
        "quantization": quantization or "none",
        "reference_quantization": args.reference_quantization,
        "prompts": len(prompts),
        "tokens_per_prompt": args.max_tokens,
        "prompts_equal": sum(p["equal"] for p in partings),
        **agreement,
        "partings": partings,
    }


def _print_partings(partings: list[dict[str, Any]]) -> None:
    for index, parting in enumerate(partings):
        if parting["equal"]:
            print(f"prompt {index}: tokens equal")
            continue
        bound = ">" if parting["gap_is_lower_bound"] else ""
        print(
            f"prompt {index}: parts at token {parting['first_difference']} "
            f"(reference {parting['reference_token']}, quantized {parting['quantized_token']}; "
            f"reference log-prob gap {bound}{parting['logprob_gap']:.3f})"
        )


def main(args: argparse.Namespace) -> int:
    result = benchmark(args)
    report(result, args)
    _print_partings(result["partings"])
    return 0
