"""`Sampler`: next tokens from logits, batched on the device.

Per row, in order: the tokens structured outputs forbid masked (xgrammar's bitmask kernel, only on
the constrained rows), banned tokens masked, repetition / presence / frequency penalties, then
greedy (temperature 0) or temperature with top-k, top-p and min-p, all as tensor ops over the batch.
A draw uses the exponential-race trick (argmax of probs / Exp(1) noise), whose noise comes from the
global generator, or, for a seeded request, from a generator seeded for that one draw, so a seeded
request's tokens do not depend on what else is in the batch. Log-probabilities are those of the
model's raw distribution (after the grammar's mask, bans and penalties, before temperature and
filters); every draw's own log-probability is computed (one logsumexp per row), the top-k only where
asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.core import SampleOutput, SequenceInput, TokenBitmask, TokenLogprobs
from attnserve.host_copy import device_tensor, to_device
from attnserve.sampling_params import SamplingParams
from attnserve.structured_outputs import load_xgrammar


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
        inputs: list[SequenceInput],
        token_bitmask: TokenBitmask | None = None,
    ) -> list[SampleOutput]:
        """logits [N, V] float32, one row per input that samples -> one result per input."""
        draw = self.draw(logits, inputs, token_bitmask)
        return self.split(draw.tokens.tolist(), draw.token_logprobs.tolist(), draw.top, draw.counts)

    def draw(
        self,
        logits: torch.Tensor,
        inputs: list[SequenceInput],
        token_bitmask: TokenBitmask | None = None,
    ) -> Draws:
        """Each input's draws (see `Draws`); `token_bitmask` rows index `inputs`."""
        params = [s.sampling for s in inputs if s.sampling is not None]
        if len(params) != len(inputs):
            raise ValueError("every input given to the sampler must carry sampling params")
        logits = self._constrain(logits, token_bitmask)
        logits = self._apply_penalties(self._ban(logits, inputs), inputs)
        counts = [s.num_samples for s in inputs]
        draws = logits
        if max(counts) > 1:
            draws = logits.repeat_interleave(device_tensor(counts, logits.device), dim=0)
        draw_params = [p for p, n in zip(params, counts, strict=True) for _ in range(n)]
        seeds = [
            None if s.sample_seed is None else s.sample_seed + d
            for s in inputs
            for d in range(s.num_samples)
        ]
        tokens = self.sample(draws, draw_params, seeds)
        chosen = draws.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(draws, dim=-1)
        return Draws(tokens, chosen, self._top(draws, tokens, chosen, draw_params), counts)

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
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]
    ) -> torch.Tensor:
        """One draw per row of `logits` [N, V] -> token ids [N] (int64)."""
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        device = logits.device
        temperature = device_tensor([p.temperature or 1.0 for p in params], device)
        probs = torch.softmax(self._filter(logits / temperature[:, None], params), dim=-1)
        noise = self._exponential_noise(probs, seeds)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = device_tensor([p.greedy for p in params], device)
        return torch.where(is_greedy, greedy_tokens, sampled)

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
    def _ban(logits: torch.Tensor, inputs: list[SequenceInput]) -> torch.Tensor:
        rows = [(r, t) for r, s in enumerate(inputs) for t in s.banned_token_ids]
        if not rows:
            return logits
        index = device_tensor(rows, logits.device).T
        return logits.index_put((index[0], index[1]), logits.new_full((), -float("inf")))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, inputs: list[SequenceInput]) -> torch.Tensor:
        rows = [
            r for r, s in enumerate(inputs) if s.sampling is not None and s.sampling.has_penalties
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for r in rows:
            s, p = inputs[r], inputs[r].sampling
            if p is None or s.prompt_token_ids is None or s.output_token_ids is None:
                raise ValueError("penalties need the prompt and output token ids")
            row = logits[r]
            output = device_tensor(s.output_token_ids, row.device, torch.int64)
            counts = torch.zeros_like(row).index_add_(
                0, output, torch.ones_like(output, dtype=row.dtype)
            )
            seen = counts > 0
            seen[device_tensor(s.prompt_token_ids, row.device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, scaled, row)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            logits[r] = row
        return logits

    @staticmethod
    def _top(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        chosen: torch.Tensor,
        params: list[SamplingParams],
    ) -> list[TokenLogprobs] | None:
        wanted = [p.logprobs is not None or p.num_candidates > p.n for p in params]
        if not any(wanted):
            return None
        ks = [p.logprobs or 0 for p in params]
        return top_logprobs(torch.log_softmax(logits, dim=-1), tokens, ks, chosen)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Mask out tokens outside each row's top-k, top-p nucleus and min-p floor."""
        vocab = logits.shape[-1]
        device = logits.device
        top_k = device_tensor([p.top_k if p.top_k > 0 else vocab for p in params], device)
        top_p = device_tensor([p.top_p for p in params], device)
        min_p = device_tensor([p.min_p for p in params], device)
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
    def _exponential_noise(probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for row, seed in enumerate(seeds):
            if seed is not None:
                generator = torch.Generator(device=probs.device).manual_seed(seed)
                noise[row].exponential_(generator=generator)
        return noise
