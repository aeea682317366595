"""Greedy tokens of one engine configuration, as JSON (a helper of scripts/gpu_tp_check.sh).

Run once per tensor-parallel degree (each in its own process, so every run has the GPUs to
itself), then `--compare` the files: the first differing position of each prompt, if any.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def generate(args: argparse.Namespace) -> None:
    from attnserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=2048,
    )
    loaded = time.perf_counter() - started
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 33, 128, 500)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    result = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "load_seconds": loaded,
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }
    with open(args.out, "w") as handle:
        json.dump(result, handle)
    print(json.dumps(result))


def compare(reference: str, other: str) -> int:
    with open(reference) as a, open(other) as b:
        want, got = json.load(a)["tokens"], json.load(b)["tokens"]
    equal = 0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        diverge = next((j for j, (x, y) in enumerate(zip(w, g, strict=True)) if x != y), None)
        if diverge is None:
            equal += 1
            print(f"prompt {i}: all {len(w)} tokens equal")
        else:
            print(f"prompt {i}: diverges at token {diverge} (equal before it): {w} vs {g}")
    print(f"{equal}/{len(want)} prompts fully equal")
    return 0 if equal == len(want) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default="tokens.json")
    parser.add_argument("--compare", nargs=2, metavar=("REFERENCE", "OTHER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    generate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
