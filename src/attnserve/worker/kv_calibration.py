"""The fp8 KV cache's calibration plan: a prefill of random tokens that computes the scales.

An fp8 cache stores key / k_scale and value / v_scale per layer and KV head (`KVCacheScales`).
The model runner computes the scales once, from real activations of the loaded model, before the
cache holds anything it keeps and before it captures CUDA graphs: it runs this plan inside
`calibrating_kv_scales`, so each attention layer widens its scales to the keys and values it
writes. The batch is `CALIBRATION_TOKENS` seeded random token ids (no more than one step may
take, or the cache hold) in prompts of up to `CALIBRATION_PROMPT_LEN` tokens, each on blocks of
its own, so every layer attends as it would to real prompts and sees the activations they give.
Nothing samples; the blocks are free again afterwards, their contents overwritten by later use.
"""

from __future__ import annotations

import torch

from attnserve.step_types import StepPlan
from attnserve.worker.profile_run import start_up_sequence

CALIBRATION_TOKENS = 2048
CALIBRATION_PROMPT_LEN = 512
CALIBRATION_SEED = 0


def calibration_plan(
    vocab_size: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
) -> StepPlan:
    """The calibration prefill (see the module docstring) for a cache of `num_blocks`."""
    budget = min(CALIBRATION_TOKENS, max_num_batched_tokens)
    prompt_len = min(CALIBRATION_PROMPT_LEN, budget, max_model_len, num_blocks * block_size)
    blocks_per_prompt = -(-prompt_len // block_size)
    num_prompts = max(1, min(budget // prompt_len, num_blocks // blocks_per_prompt))
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    tokens = torch.randint(vocab_size, (num_prompts, prompt_len), generator=generator)
    seqs = [
        start_up_sequence(
            index,
            tokens[index].tolist(),
            0,
            list(range(index * blocks_per_prompt, (index + 1) * blocks_per_prompt)),
            None,
        )
        for index in range(num_prompts)
    ]
    return StepPlan.of_new(seqs)
