"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): for each prompt token a step
computes that has a next prompt token, the log-probability of that next token and the top-k,
from the step's final hidden states."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from attnserve.host_copy import device_tensor
from attnserve.step_types import SampleOutput
from attnserve.worker.input_batch import PreparedStep
from attnserve.worker.sampler import top_logprobs


def add_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    step: PreparedStep,
    hidden: torch.Tensor,
    starts: list[int],
    results: list[SampleOutput | None],
) -> None:
    """Set each sequence's `prompt_logprobs` in `results` (sequence i's new tokens are
    `hidden[starts[i]:]`), where it asks for them and the step computes prompt tokens."""
    contexts: list[int] = step.layout.context_lens.tolist()
    queries: list[int] = step.layout.query_lens.tolist()
    for i, state in enumerate(step.states):
        targets = state.prompt_logprob_targets(contexts[i], queries[i])
        if not targets or state.sampling is None:
            continue
        rows = hidden[starts[i] : starts[i] + len(targets)]
        logprobs = torch.log_softmax(compute_logits(rows), dim=-1)
        chosen = device_tensor(targets, hidden.device)
        ks = [state.sampling.prompt_logprobs or 0] * len(targets)
        previous = results[i] or SampleOutput([])
        results[i] = dataclasses.replace(
            previous, prompt_logprobs=top_logprobs(logprobs, chosen, ks)
        )
