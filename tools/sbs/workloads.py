"""Writes the offline workloads of the side-by-side runs (tools/sbs/drive.py) for one dummy preset,
with attnserve importable, and the preset's HF config dir (what vLLM loads with dummy weights):

    PYTHONPATH=src python3 tools/sbs/workloads.py PRESET OUTDIR

OUTDIR/PRESET/config.json and OUTDIR/PRESET-KIND.json for each kind of
`attnserve.bench.workloads` (standard, chat, long, prefix, short: prompts as token ids, output
lengths), drawn as `attnserve bench throughput --workload KIND` draws them.
"""

from __future__ import annotations

import json
import os
import sys

from attnserve.bench.workloads import KINDS, draw_workload
from attnserve.model.presets import preset_hf_config


def main() -> None:
    preset, outdir = sys.argv[1:3]
    config = preset_hf_config(preset)
    config.torch_dtype = "bfloat16"
    os.makedirs(f"{outdir}/{preset}", exist_ok=True)
    config.to_json_file(f"{outdir}/{preset}/config.json", use_diff=False)
    for kind in KINDS:
        work = draw_workload(kind, config.vocab_size)
        with open(f"{outdir}/{preset}-{kind}.json", "w") as f:
            data = {"prompts": work.prompts, "output_lens": work.output_lens}
            json.dump(data | {"vocab_size": config.vocab_size}, f)
        print(
            preset,
            kind,
            len(work.prompts),
            "requests,",
            sum(work.input_lens),
            "prompt tokens,",
            work.output_tokens,
            "output tokens",
        )


if __name__ == "__main__":
    main()
