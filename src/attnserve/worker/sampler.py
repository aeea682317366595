"""`Sampler`: next tokens from logits, batched on the device.

Per row, in order: `logit_bias` added, banned tokens masked, repetition / presence / frequency
penalties (each only for the rows that have them, one batched scatter each), then the tokens
structured outputs forbid masked (xgrammar's bitmask kernel, only on the constrained rows; last, so
no bias or penalty can let a forbidden token back in), then greedy (temperature 0) or temperature
with top-k, top-p and min-p, all as tensor ops over the batch. A draw uses the exponential-race
trick (argmax of probs / Exp(1) noise), whose noise comes from the global generator, or, for a
seeded request, from a generator seeded for that one draw, so a seeded request's tokens do not
depend on what else is in the batch. Log-probabilities are those of the model's distribution after
bias, bans, penalties and the grammar's mask (before temperature and filters); every draw's own
log-probability is computed (one logsumexp per row), the top-k only where asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from attnserve.host_copy import device_tensor, to_device
from attnserve.output_constraints import load_xgrammar
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import SampleOutput, TokenBitmask, TokenLogprobs
from attnserve.worker.sampling_metadata import (
    MIN_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingMetadata,
)


def top_logprobs(
    logprobs: torch.Tensor,
    chosen: torch.Tensor,
    ks: list[int],
    chosen_values: torch.Tensor | None = None,
) -> list[TokenLogprobs]:
    """Per row of `logprobs` [N, V]: the chosen token's log-probability (`chosen_values` when
    given, else read from `logprobs`) and the row's top k."""
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    if chosen_values is None:
        chosen_values = logprobs.gather(-1, chosen[:, None]).squeeze(-1)
    rows = []
    for token, value, ids, values, k in zip(
        chosen.tolist(),
        chosen_values.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        ks,
        strict=True,
    ):
        entry = dict(zip(ids[:k], values[:k], strict=True))
        entry[token] = value
        rows.append(entry)
    return rows


class SamplingRow(Protocol):
    """What the sampler reads of one row: how to sample, the seed of its first draw (None: the
    global generator), how many independent draws (a parallel-sampling fork), tokens it may not
    draw (EOS before min_tokens), and, where penalties apply, the prompt and the outputs."""

    @property
    def sampling(self) -> SamplingParams | None: ...

    @property
    def sample_seed(self) -> int | None: ...

    @property
    def num_samples(self) -> int: ...

    @property
    def banned_token_ids(self) -> tuple[int, ...]: ...

    @property
    def prompt_token_ids(self) -> list[int] | None: ...

    @property
    def output_token_ids(self) -> list[int] | None: ...


@dataclass(frozen=True)
class Draws:
    """A step's draws: the tokens on the device ([sum of counts] int64, each input's draws in a
    run), each one's log-probability (on the device, float32), the top-k entries where asked for
    (on the host), and each input's number of draws."""

    tokens: torch.Tensor
    token_logprobs: torch.Tensor
    top: list[TokenLogprobs] | None
    counts: list[int]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        inputs: Sequence[SamplingRow],
        token_bitmask: TokenBitmask | None = None,
    ) -> list[SampleOutput]:
        """logits [N, V] float32, one row per input that samples -> one result per input."""
        metadata = SamplingMetadata.from_rows(inputs, logits.device)
        draw = self.draw(logits, inputs, metadata, token_bitmask)
        return self.split(draw.tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts)

    def draw(
        self,
        logits: torch.Tensor,
        inputs: Sequence[SamplingRow],
        metadata: SamplingMetadata,
        token_bitmask: TokenBitmask | None = None,
    ) -> Draws:
        """Each input's draws (see `Draws`); `metadata` holds the inputs' parameters in their
        order, and `token_bitmask` rows index `inputs`. A per-row pass runs only for the
        features `metadata` says some input uses."""
        if metadata.any_bias:
            logits = self._apply_bias(logits, inputs)
        if metadata.any_min_tokens:
            logits = self._ban(logits, inputs)
        if metadata.any_penalties:
            logits = self._apply_penalties(logits, inputs)
        logits = self._constrain(logits, token_bitmask)
        counts: list[int] = metadata.num_samples.tolist()
        draws, per_draw = logits, metadata
        if max(counts, default=1) > 1:  # a fork's first draws: its row repeated
            repeats = device_tensor(counts, logits.device)
            draws, per_draw = logits.repeat_interleave(repeats, dim=0), metadata.repeated(repeats)
        seeds = self._seeds(inputs, counts) if metadata.any_seed else None
        tokens = self.sample(draws, per_draw, seeds)
        chosen = draws.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(draws, dim=-1)
        top = None
        if metadata.any_logprobs:
            ks = [_num_logprobs(s) for s, n in zip(inputs, counts, strict=True) for _ in range(n)]
            top = top_logprobs(torch.log_softmax(draws, dim=-1), tokens, ks, chosen)
        return Draws(tokens, chosen, top, counts)

    @staticmethod
    def _seeds(inputs: Sequence[SamplingRow], counts: list[int]) -> list[int | None]:
        """Each draw's seed: its row's, plus the draw's index among the row's draws."""
        return [
            None if s.sample_seed is None else s.sample_seed + d
            for s, n in zip(inputs, counts, strict=True)
            for d in range(n)
        ]

    @staticmethod
    def split(
        tokens: list[int],
        token_logprobs: list[float],
        top: list[TokenLogprobs] | None,
        counts: list[int],
    ) -> list[SampleOutput]:
        """Per input, its `count` draws and their log-probabilities."""
        if top is None and len(tokens) == len(counts):
            return [
                SampleOutput([token], token_logprobs=[logprob])
                for token, logprob in zip(tokens, token_logprobs, strict=True)
            ]
        results, start = [], 0
        for count in counts:
            end = start + count
            chunk = None if top is None else top[start:end]
            results.append(SampleOutput(tokens[start:end], chunk, token_logprobs[start:end]))
            start = end
        return results

    def sample(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        seeds: list[int | None] | None = None,
    ) -> torch.Tensor:
        """One draw per row of `logits` [N, V] (`metadata` has a row each; `seeds`: each
        row's, None for the global generator) -> token ids [N] (int64)."""
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_tokens
        temperature = metadata.column(TEMPERATURE)
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if metadata.any_filters:
            scaled = self._filter(scaled, metadata)
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(probs, seeds)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(temperature == 0, greedy_tokens, sampled)

    @staticmethod
    def _constrain(logits: torch.Tensor, token_bitmask: TokenBitmask | None) -> torch.Tensor:
        """-inf on each constrained row's forbidden tokens, in place, on the device."""
        if token_bitmask is None:
            return logits
        apply = load_xgrammar().apply_token_bitmask_inplace
        bitmask = to_device(token_bitmask.bitmask, logits.device)
        if len(token_bitmask.rows) == len(logits):  # every row constrained
            apply(logits, bitmask)
            return logits
        index = device_tensor(token_bitmask.rows, logits.device)
        rows = logits[index]
        apply(rows, bitmask)
        return logits.index_copy_(0, index, rows)

    @staticmethod
    def _ban(logits: torch.Tensor, inputs: Sequence[SamplingRow]) -> torch.Tensor:
        rows = [(r, t) for r, s in enumerate(inputs) for t in s.banned_token_ids]
        if not rows:
            return logits
        index = device_tensor(rows, logits.device).T
        return logits.index_put((index[0], index[1]), logits.new_full((), -float("inf")))

    @staticmethod
    def _apply_bias(logits: torch.Tensor, inputs: Sequence[SamplingRow]) -> torch.Tensor:
        """Each row's `logit_bias` added to its logits (one scatter over every biased row)."""
        entries = [
            (r, token, bias)
            for r, s in enumerate(inputs)
            if s.sampling is not None and s.sampling.logit_bias
            for token, bias in s.sampling.logit_bias.items()
        ]
        if not entries:
            return logits
        rows, tokens, biases = zip(*entries, strict=True)
        index = device_tensor([rows, tokens], logits.device)
        values = device_tensor(biases, logits.device, logits.dtype)
        return logits.index_put((index[0], index[1]), values, accumulate=True)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, inputs: Sequence[SamplingRow]) -> torch.Tensor:
        """Repetition (vLLM's: a seen token's logit divided by the penalty if positive, else
        multiplied; seen = in the prompt or the output), frequency and presence penalties
        (output counts), for the rows that have any, all at once."""
        rows = [
            r for r, s in enumerate(inputs) if s.sampling is not None and s.sampling.has_penalties
        ]
        if not rows:
            return logits
        seqs = [inputs[r] for r in rows]
        if any(s.prompt_token_ids is None or s.output_token_ids is None for s in seqs):
            raise ValueError("penalties need the prompt and output token ids")
        device = logits.device
        outputs = _flat_index([s.output_token_ids or [] for s in seqs], device)
        prompts = _flat_index([s.prompt_token_ids or [] for s in seqs], device)
        penalised = logits[device_tensor(rows, device)]
        counts = torch.zeros_like(penalised).index_put_(
            outputs, penalised.new_ones(()), accumulate=True
        )
        seen = (counts > 0).index_put_(prompts, torch.ones((), dtype=torch.bool, device=device))
        params = [s.sampling for s in seqs if s.sampling is not None]
        repetition = device_tensor([p.repetition_penalty for p in params], device)[:, None]
        frequency = device_tensor([p.frequency_penalty for p in params], device)[:, None]
        presence = device_tensor([p.presence_penalty for p in params], device)[:, None]
        scaled = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
        penalised = torch.where(seen, scaled, penalised)
        penalised = penalised - frequency * counts - presence * (counts > 0).to(logits.dtype)
        return logits.index_copy(0, device_tensor(rows, device), penalised)

    @staticmethod
    def _filter(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Mask out tokens outside each row's top-k, top-p nucleus and min-p floor."""
        vocab = logits.shape[-1]
        device = logits.device
        top_k = metadata.column(TOP_K)
        top_k = torch.where(top_k > 0, top_k, vocab)
        top_p, min_p = metadata.column(TOP_P), metadata.column(MIN_P)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        masked = sorted_logits.masked_fill(drop, -float("inf"))
        return torch.empty_like(logits).scatter_(-1, order, masked)

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, seeds: list[int | None] | None) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for row, seed in enumerate(seeds or ()):
            if seed is not None:
                generator = torch.Generator(device=probs.device).manual_seed(seed)
                noise[row].exponential_(generator=generator)
        return noise


def _num_logprobs(row: SamplingRow) -> int:
    return (row.sampling.logprobs or 0) if row.sampling is not None else 0


def _flat_index(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every token of every row, for one scatter over them all."""
    row_ids = [r for r, tokens in enumerate(rows) for _ in tokens]
    token_ids = [t for tokens in rows for t in tokens]
    index = device_tensor([row_ids, token_ids], device, torch.int64)
    return index[0], index[1]
