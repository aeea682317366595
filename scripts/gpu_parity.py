"""Engine greedy tokens against HF transformers on the same dummy weights, per backend.

Run on the GPU machine (no weights there): for each model preset, dtype, attention backend
and CUDA-graph mode, `LLM(..., load_format="dummy")` generates greedily for a few random-token
prompts; HF transformers, built from the same engine's weights (`to_hf_model`), generates for
the same prompts. Prints, per prompt, the number of leading tokens that agree (the first
divergence point when they part) and a summary line per configuration; `--json` writes them.
Where a prompt parts, HF re-scores the shared prefix in the run's dtype and in fp32 (the same
weights upcast): the logit gap between HF's token and ours, and the dtype's rounding step at
that logit's size, say whether the two tokens were a tie within rounding.

    PYTHONPATH=src:. python3 scripts/gpu_parity.py --models qwen3-0.6b \
        --dtypes bfloat16,float32 --backends TRITON,FLASHINFER,FLEX_ATTENTION --tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from typing import Any

import torch

from attnserve import LLM, SamplingParams
from attnserve.model.hf_export import to_hf_model

PROMPT_LENS = (7, 33, 130, 517)


def hf_greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """HF `generate`, one prompt at a time (no padding), on the engine's weights."""
    engine = llm.llm_engine
    hf = to_hf_model(engine.executor.driver_runner.model, engine.model_config)
    hf.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=hf.device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    del hf
    return outputs


def agreement(ours: list[int], reference: list[int]) -> int:
    """Leading tokens that agree."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return i
    return min(len(ours), len(reference))


def _spacing(value: float, dtype: torch.dtype) -> float:
    """The dtype's distance between neighbouring values at `value`'s magnitude."""
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(value), 1e-30)))


def parting_margins(
    llm: LLM, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> list[dict[str, Any] | None]:
    """For each prompt whose tokens part from HF's: the step, both tokens, and HF's logit gap
    (its token minus ours) after the shared prefix, in the run's dtype and in fp32."""
    engine = llm.llm_engine
    runner = engine.executor.driver_runner
    models = {
        "run_dtype": to_hf_model(runner.model, engine.model_config),
        "fp32": to_hf_model(runner.model, engine.model_config, dtype=torch.float32),
    }
    margins: list[dict[str, Any] | None] = []
    with torch.no_grad():
        for prompt, mine, reference in zip(prompts, ours, theirs, strict=True):
            step = agreement(mine, reference)
            if step >= min(len(mine), len(reference)):
                margins.append(None)
                continue
            ids = torch.tensor([prompt + reference[:step]], device=runner.device)
            record: dict[str, Any] = {"step": step, "hf_token": reference[step]}
            record["our_token"] = mine[step]
            for name, hf in models.items():
                logits = hf(ids).logits[0, -1].float()
                record[f"gap_{name}"] = float(logits[reference[step]] - logits[mine[step]])
                if name == "run_dtype":  # the rounding step at the winning logit's size
                    top = float(logits[reference[step]])
                    record["spacing"] = _spacing(top, engine.model_config.dtype)
            margins.append(record)
    del models
    return margins


def run_config(
    model: str, dtype: str, backend: str, eager: bool, tokens: int, reference: dict[str, Any]
) -> dict[str, Any]:
    started = time.perf_counter()
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype=dtype,
        attention_backend=backend,
        enforce_eager=eager,
        gpu_memory_utilization=0.5,
    )
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    key = f"{model}/{dtype}"
    if key not in reference:
        reference[key] = hf_greedy(llm, prompts, tokens)
    agree = [agreement(a, b) for a, b in zip(ours, reference[key], strict=True)]
    partings = parting_margins(llm, prompts, ours, reference[key]) if min(agree) < tokens else []
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "model": model,
        "dtype": dtype,
        "backend": backend,
        "enforce_eager": eager,
        "prompt_lens": list(PROMPT_LENS),
        "agreeing_tokens": agree,
        "all_equal": all(n == tokens for n in agree),
        "partings": partings,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-0.6b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--backends", default="TRITON,FLASHINFER,FLEX_ATTENTION")
    parser.add_argument("--eager", default="1,0", help="enforce_eager values to run (1, 0)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    reference: dict[str, Any] = {}
    results = []
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for backend in args.backends.split(","):
                for eager in (flag == "1" for flag in args.eager.split(",")):
                    try:
                        result = run_config(model, dtype, backend, eager, args.tokens, reference)
                    except ValueError as error:  # backend cannot serve this config: say why
                        result = {
                            "model": model,
                            "dtype": dtype,
                            "backend": backend,
                            "enforce_eager": eager,
                            "skipped": str(error).splitlines()[0],
                        }
                    print(json.dumps(result), flush=True)
                    results.append(result)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    failed = [r for r in results if r.get("all_equal") is False and r["dtype"] == "float32"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
