"""Writes the offline workloads of the side-by-side runs (tools/sbs/drive.py) for one dummy preset,
with attnserve importable, and the preset's HF config dir (what vLLM loads with dummy weights):

    PYTHONPATH=src python3 tools/sbs/workloads.py PRESET OUTDIR

OUTDIR/PRESET/config.json and OUTDIR/PRESET-KIND.json for each kind (prompts as token ids, output
lengths), all drawn as `attnserve bench throughput` draws them (uniform lengths, seeded):
- standard: 256 requests, 100..1024 tokens in and out (nano-vllm's workload)
- long: 64 requests of 4096..6144 prompt tokens, 16..64 out
- prefix: 256 requests sharing a 2048-token prefix, then 64..256 tokens of their own, 64..256 out
- short: 1024 requests of 16..128 tokens in and out
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from attnserve.bench.throughput import make_workload
from attnserve.model.presets import preset_hf_config

KINDS = {  # kind: (requests, min_len, max_len, shared prefix, output min, output max)
    "standard": (256, 100, 1024, 0, 100, 1024),
    "long": (64, 4096, 6144, 0, 16, 64),
    "prefix": (256, 64, 256, 2048, 64, 256),
    "short": (1024, 16, 128, 0, 16, 128),
}


def main() -> None:
    preset, outdir = sys.argv[1:3]
    config = preset_hf_config(preset)
    config.torch_dtype = "bfloat16"
    os.makedirs(f"{outdir}/{preset}", exist_ok=True)
    config.to_json_file(f"{outdir}/{preset}/config.json", use_diff=False)
    for kind, (num, low, high, prefix, out_low, out_high) in KINDS.items():
        work = make_workload(_args(num, low, high, prefix), config.vocab_size)
        lengths = work.output_lens  # the standard workload's, drawn with its prompts
        if (out_low, out_high) != (low, high):
            rng = random.Random(1)
            lengths = [rng.randint(out_low, out_high) for _ in range(num)]
        with open(f"{outdir}/{preset}-{kind}.json", "w") as f:
            json.dump(
                {"prompts": work.prompts, "output_lens": lengths, "vocab_size": config.vocab_size},
                f,
            )
        print(
            preset,
            kind,
            num,
            "requests,",
            sum(map(len, work.prompts)),
            "prompt tokens,",
            sum(lengths),
            "output tokens",
        )


def _args(num: int, low: int, high: int, prefix: int) -> argparse.Namespace:
    return argparse.Namespace(
        seed=0,
        min_len=low,
        max_len=high,
        input_len=None,
        output_len=None,
        shared_prefix=prefix,
        num_prompts=num,
    )


if __name__ == "__main__":
    main()
