"""A sampler row for tests: the `SamplingRow` fields, given directly."""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.sampling_params import SamplingParams


@dataclass
class Row:
    sampling: SamplingParams | None
    sample_seed: int | None = None
    num_samples: int = 1
    banned_token_ids: tuple[int, ...] = ()
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
