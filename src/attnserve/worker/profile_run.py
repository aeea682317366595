"""The profile run's plan: the largest step the scheduler may ever send, as dummy prefills.

Before the KV cache exists, the model runner runs this plan once against a one-block cache and
measures the peak memory it takes (vLLM's `profile_run`), so the cache leaves that much of the
`gpu_memory_utilization` share free. The plan fills both limits at once: `max_num_batched_tokens`
new tokens in all, spread over as many sequences as may run together (`max_num_seqs`, each at
most `max_model_len` long), every one sampling with top-k and top-p so the sampler takes its
costliest path over `max_num_seqs` rows of logits. The first sequence continues a chunked prefill
(up to one block of cached context), so the step takes that attention path too and whatever it
compiles on first use is ready before the first request. Every block-table entry is block 0: the
writes and reads stay inside the one-block cache, and the outputs are garbage nobody reads.

The warm-up plans are the longest prompt one step can hold, once from its start and once
continuing a chunk after one cached block: kernels that take other tiles or code paths for long
prompts (and compile on first use) compile at start-up, not inside the first long request. They
also write only block 0, of the real cache: a block is written by its owner before it is read.
"""

from __future__ import annotations

from attnserve.sampling_params import SamplingParams
from attnserve.step_types import NewSequence, StepPlan

# top-k and top-p both on: the sampler's sort and its filters run (greedy would skip them)
PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)


def start_up_sequence(
    index: int,
    token_ids: list[int],
    num_computed_tokens: int,
    block_ids: list[int],
    sampling: SamplingParams | None,
) -> NewSequence:
    """A sequence of a start-up run: ids below zero, which the engine never uses."""
    return NewSequence(
        seq_id=-1 - index,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
        num_computed_tokens=num_computed_tokens,
        block_ids=block_ids,
        sampling=sampling,
    )


def _on_block_zero(
    index: int, length: int, context: int, block_size: int, sampling: SamplingParams
) -> NewSequence:
    """`length` new tokens after `context` cached ones, every block-table entry block 0."""
    blocks = [0] * -(-(context + length) // block_size)
    return start_up_sequence(index, [0] * (context + length), context, blocks, sampling)


def profile_plan(
    max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> StepPlan:
    """The profile run's plan (see the module docstring)."""
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_model_len", max_model_len),
        ("block_size", block_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_seqs = min(max_num_seqs, num_tokens)
    base, extra = divmod(num_tokens, num_seqs)
    seqs = []
    for index in range(num_seqs):
        length = base + (index < extra)
        context = min(block_size, max_model_len - length) if index == 0 else 0
        seqs.append(_on_block_zero(index, length, context, block_size, PROFILE_SAMPLING))
    return StepPlan.of_new(seqs)


def warm_up_plans(
    max_num_batched_tokens: int, max_model_len: int, block_size: int
) -> list[StepPlan]:
    """The warm-up plans (see the module docstring): one sequence each, greedy."""
    length = min(max_num_batched_tokens, max_model_len - block_size)
    if length < 2:  # no long prompt fits: nothing beyond what the profile run compiles
        return []
    greedy = SamplingParams(temperature=0.0)
    return [
        StepPlan.of_new([_on_block_zero(0, length, context, block_size, greedy)])
        for context in (0, block_size)
    ]
