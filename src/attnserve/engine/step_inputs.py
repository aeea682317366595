"""From the scheduler's decision to the worker's plain `ScheduledBatch`.

Engine policy becomes data here: which tokens may not be drawn yet (EOS and stop tokens before
`min_tokens`), what penalties need to see, whose prompt log-probabilities to compute, how many
draws a prompt makes for parallel sampling, which tokens structured outputs allow.
"""

from __future__ import annotations

from attnserve.core import ScheduledBatch, SequenceInput
from attnserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from attnserve.engine.sequence_grammar import token_bitmask


def _banned(item: ScheduledSequence, eos_token_ids: list[int]) -> tuple[int, ...]:
    params = item.seq.sampling_params
    if not params.min_tokens or item.seq.num_output_tokens >= params.min_tokens:
        return ()
    eos = [] if params.ignore_eos else eos_token_ids
    return tuple(dict.fromkeys([*params.stop_token_ids, *eos]))


def _prompt_logprob_targets(item: ScheduledSequence) -> list[int] | None:
    seq = item.seq
    if seq.sampling_params.prompt_logprobs is None or seq.num_output_tokens or seq.index:
        return None
    start = seq.num_computed_tokens
    end = min(start + item.num_new_tokens + 1, seq.num_prompt_tokens)
    return seq.token_ids[start + 1 : end]


def _sequence_input(item: ScheduledSequence, eos_token_ids: list[int]) -> SequenceInput:
    seq, start = item.seq, item.seq.num_computed_tokens
    params = seq.sampling_params
    samples = item.samples
    penalties = samples and params.has_penalties
    return SequenceInput(
        token_ids=seq.token_ids[start : start + item.num_new_tokens],
        context_len=start,
        block_table=list(seq.block_table.blocks),
        sampling=params if samples else None,
        sample_seed=seq.sample_seed() if samples else None,
        num_samples=1 + seq.num_forks_pending if samples else 1,
        banned_token_ids=_banned(item, eos_token_ids) if samples else (),
        prompt_token_ids=seq.prompt_token_ids if penalties else None,
        output_token_ids=seq.output_token_ids if penalties else None,
        prompt_logprob_targets=_prompt_logprob_targets(item),
        num_prompt_logprobs=params.prompt_logprobs or 0,
    )


def build_batch(
    out: SchedulerOutput,
    eos_token_ids: list[int],
    carried_tokens: list[tuple[int, int]] | None = None,
) -> ScheduledBatch:
    return ScheduledBatch(
        seqs=[_sequence_input(item, eos_token_ids) for item in out.scheduled],
        blocks_to_swap_in=out.swap_in,
        blocks_to_swap_out=out.swap_out,
        blocks_to_copy=out.copies,
        carried_tokens=carried_tokens or [],
        token_bitmask=token_bitmask([i.seq.grammar for i in out.scheduled if i.samples]),
    )
