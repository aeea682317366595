"""Side-by-side driver for the GPU machine: one engine (attnserve or vLLM), one model shape, every
offline workload kind of tools/sbs/workloads.py in one engine instance, timed the same way through
each engine's own offline `LLM.generate` (token-id prompts, greedy, `ignore_eos`, dummy weights):

    python3 drive.py ENGINE PRESET WORKLOAD_DIR [--kinds standard,long,...] [--latency]
        [--quantization Q] [--kv-cache-dtype D] [--kv-cache-memory-bytes N] [--max-model-len N]
        [--out FILE.json]

ENGINE: attnserve (PRESET is its dummy preset) or vllm (it loads WORKLOAD_DIR/PRESET, the same
config as an HF dir). Every kind runs after a 2-request warm-up; latency: batches of 1 and 8,
128 tokens in and out, median of 3 after a warm-up (as vLLM's benchmark_latency). Needs nothing
of attnserve when ENGINE is vllm. Prints one line per figure, then all of them as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

OPTIONS = ("quantization", "kv_cache_dtype", "kv_cache_memory_bytes", "max_model_len")


def make_engine(args: argparse.Namespace) -> Any:
    extra = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
    if args.engine == "vllm":
        from vllm import LLM

        model = f"{args.workload_dir}/{args.preset}"
        return LLM(
            model=model,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            **extra,
        )
    from attnserve import LLM as AttnLLM

    return AttnLLM(args.preset, load_format="dummy", dtype="bfloat16", seed=0, **extra)


def generate(engine: str, llm: Any, prompts: list[list[int]], outs: list[int]) -> tuple[float, int]:
    """Seconds of one `generate` call over all the prompts, and the tokens it made."""
    import torch

    if engine == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs: list[Any] = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in outs
        ]
    else:
        from attnserve import SamplingParams as AttnParams

        inputs = prompts
        params = [AttnParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    results = llm.generate(inputs, params, use_tqdm=False)
    sync()
    return time.perf_counter() - start, sum(len(r.outputs[0].token_ids) for r in results)


def run_kind(args: argparse.Namespace, llm: Any, kind: str, rng: random.Random) -> dict[str, Any]:
    with open(f"{args.workload_dir}/{args.preset}-{kind}.json") as f:
        work = json.load(f)
    prompts, outs = work["prompts"], work["output_lens"]
    vocab = work["vocab_size"]
    warm = [[rng.randrange(vocab) for _ in range(len(p))] for p in prompts[:2]]
    generate(args.engine, llm, warm, [8, 8])
    seconds, made = generate(args.engine, llm, prompts, outs)
    prompt_tokens = sum(map(len, prompts))
    row = {
        "kind": kind,
        "requests": len(prompts),
        "seconds": round(seconds, 3),
        "output_tokens": made,
        "expected_tokens": sum(outs),
        "output_tok_per_s": round(made / seconds, 1),
        "total_tok_per_s": round((made + prompt_tokens) / seconds, 1),
        "requests_per_s": round(len(prompts) / seconds, 2),
    }
    print(
        f"[{args.engine}] {kind}: {made / seconds:,.0f} output tok/s, "
        f"{(made + prompt_tokens) / seconds:,.0f} total tok/s ({seconds:.2f} s)",
        flush=True,
    )
    return row


def run_latency(
    args: argparse.Namespace, llm: Any, rng: random.Random, vocab: int
) -> dict[str, float]:
    result = {}
    for batch in (1, 8):
        runs = []
        for _ in range(4):
            prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(batch)]
            runs.append(generate(args.engine, llm, prompts, [128] * batch)[0])
        e2e = sorted(runs[1:])[1]
        result[f"latency_b{batch}_e2e_ms"] = round(e2e * 1000, 1)
        print(f"[{args.engine}] batch {batch}: {e2e * 1000:.1f} ms for 128 tokens", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=["attnserve", "vllm"])
    parser.add_argument("preset")
    parser.add_argument("workload_dir")
    parser.add_argument("--kinds", default="standard")
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--quantization")
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--kv-cache-memory-bytes", type=lambda s: int(float(s)))
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.perf_counter()
    llm = make_engine(args)
    init_s = time.perf_counter() - started
    print(f"[{args.engine}] {args.preset} ready in {init_s:.0f} s", flush=True)
    rng = random.Random(-1)
    result: dict[str, Any] = {
        "engine": args.engine,
        "model": args.preset,
        "options": {k: getattr(args, k) for k in OPTIONS},
        "init_s": round(init_s, 1),
        "kinds": [],
    }
    for kind in args.kinds.split(","):
        result["kinds"].append(run_kind(args, llm, kind, rng))
    if args.latency:
        with open(f"{args.workload_dir}/{args.preset}-standard.json") as f:
            vocab = json.load(f)["vocab_size"]
        result.update(run_latency(args, llm, rng, vocab))
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
