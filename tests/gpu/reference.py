"""What the GPU tests share: the model (Qwen3-0.6B's shape, dummy weights), the engine settings,
the prompts, and the independent reference: HF transformers' greedy tokens on exactly the
weights the engine loads (attnserve's seeded dummy init, exported with `to_hf_model`)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from attnserve import LLM, SamplingParams
from attnserve.model import ModelConfig, load_model
from attnserve.model.models.hf_export import to_hf_model

MODEL = "qwen3-0.6b"
PROMPT_LENS = (7, 33, 130, 517)
NEW_TOKENS = 32
MAX_MODEL_LEN = 1024
# A fixed KV cache (the HF reference shares the GPU) and few graph buckets (1, 2, 4, 8).
ENGINE: dict[str, Any] = {
    "load_format": "dummy",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 2 << 30,
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class Reference:
    """HF's model in one dtype, the prompts, and HF's greedy continuation of each."""

    hf: Any
    prompts: list[list[int]]
    tokens: list[list[int]]

    def next_logits(self, prompt: int, step: int) -> torch.Tensor:
        """HF's fp32-cast logits for the token after prompt `prompt` and `step` of its tokens."""
        ids = torch.tensor([self.prompts[prompt] + self.tokens[prompt][:step]], device="cuda")
        with torch.no_grad():
            return self.hf(ids).logits[0, -1].float()


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where the two token lists differ (None: equal)."""
    if ours == theirs:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )


def bf16_spacing(value: float) -> float:
    """bf16's distance between neighbouring values at `value`'s magnitude."""
    exponent = math.floor(math.log2(max(abs(value), 1e-30)))
    return float(torch.finfo(torch.bfloat16).eps) * 2.0**exponent


def assert_parts_only_at_rounding(
    reference: Reference, ours: list[list[int]], max_steps: float
) -> list[str]:
    """Where a prompt's tokens part from HF's, HF's own logits must put its token and ours
    within `max_steps` bf16 rounding steps of each other at that logit's size; the partings, as
    lines to show."""
    partings = []
    for index, (mine, theirs) in enumerate(zip(ours, reference.tokens, strict=True)):
        step = first_difference(mine, theirs)
        if step is None:
            continue
        logits = reference.next_logits(index, step)
        gap = float(logits[theirs[step]] - logits[mine[step]])
        steps = abs(gap) / bf16_spacing(float(logits[theirs[step]]))
        partings.append(f"prompt {index} at token {step}: HF gap {gap:.4g} = {steps:.2f} steps")
        assert steps <= max_steps, "; ".join(partings)
    return partings


def engine_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    """HF `generate` for one prompt (no padding), exactly NEW_TOKENS tokens."""
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def build_reference(
    dtype: str, name: str = MODEL, experts_implementation: str | None = None
) -> Reference:
    """HF's model on the dummy weights of `name` (a preset or an HF directory), in `dtype`; an
    MoE model's experts run as `experts_implementation` asks (transformers 5 defaults to its
    grouped matmul; "eager" is its expert-by-expert loop, which the torch path follows)."""
    config = ModelConfig.resolve(
        name, dtype=dtype, load_format="dummy", max_model_len=MAX_MODEL_LEN, device="cuda"
    )
    model = load_model(config, torch.device("cuda"))
    hf = to_hf_model(model, config)
    if experts_implementation is not None and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation(experts_implementation)
    del model
    torch.cuda.empty_cache()
    hf.generation_config.eos_token_id = None  # run on through EOS, like ignore_eos
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    return Reference(hf, prompts, [_hf_greedy(hf, prompt) for prompt in prompts])
