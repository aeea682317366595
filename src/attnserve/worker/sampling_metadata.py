"""A step's sampling parameters as the sampler reads them (`SamplingMetadata`), and the persistent
per-slot host arrays the input batch keeps them in (`SamplingTable`).

Each held sequence's scalar parameters (temperature, top-k, top-p, min-p) and the features it
uses (logit bias, penalties, min_tokens, a seed, log-probabilities) are written once, when the
sequence arrives; each step gathers its sampling rows' entries with one vectorised index and
copies the parameters to the device in one transfer (none when every row is greedy). The sampler
then runs a per-row pass only for the features some row of the step uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from attnserve.host_copy import to_device
from attnserve.sampling_params import SamplingParams

# the columns of SamplingMetadata.params; top-k 0 means off
TEMPERATURE, TOP_K, TOP_P, MIN_P = range(4)
# the columns of SamplingTable.features
BIAS, PENALTIES, MIN_TOKENS, SEED, LOGPROBS, FILTERS = range(6)
NUM_FEATURES = 6


class HasSampling(Protocol):
    """What `SamplingMetadata.from_rows` reads of a row."""

    @property
    def sampling(self) -> SamplingParams | None: ...

    @property
    def num_samples(self) -> int: ...


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's sampling rows: their scalar parameters on the device, their number of draws
    each, and which per-row features any of them uses."""

    params: torch.Tensor | None  # [N, 4] float32 (see the column names); None: all greedy
    num_samples: npt.NDArray[np.int64]  # [N] draws per row (> 1: a parallel-sampling fork)
    any_bias: bool
    any_penalties: bool
    any_min_tokens: bool
    any_seed: bool
    any_logprobs: bool
    any_filters: bool  # top-k, top-p or min-p

    @property
    def all_greedy(self) -> bool:
        return self.params is None

    @property
    def num_draws(self) -> int:
        return int(self.num_samples.sum())

    def column(self, index: int) -> torch.Tensor:
        if self.params is None:
            raise ValueError("every row is greedy: there are no sampling parameters")
        return self.params[:, index]

    def repeated(self, counts: torch.Tensor) -> SamplingMetadata:
        """One row per draw: each row's entries repeated `num_samples` times (`counts`: those
        numbers on the parameters' device)."""
        params = self.params
        if params is not None:
            params = params.repeat_interleave(counts, dim=0)
        return dataclasses.replace(
            self, params=params, num_samples=np.ones(self.num_draws, dtype=np.int64)
        )

    @classmethod
    def from_rows(cls, rows: Sequence[HasSampling], device: torch.device | str) -> SamplingMetadata:
        """The metadata of `rows`, each of which must carry sampling params."""
        table = SamplingTable(len(rows))
        for slot, row in enumerate(rows):
            if row.sampling is None:
                raise ValueError("every input given to the sampler must carry sampling params")
            table.set(slot, row.sampling, row.num_samples)
        return table.gather(np.arange(len(rows)), device)


class SamplingTable:
    """Per slot: the sampling parameters, the features used and the draws of the next sampling
    step, in host arrays that grow with the slots."""

    def __init__(self, capacity: int) -> None:
        self.params = np.zeros((capacity, 4), dtype=np.float32)
        self.features = np.zeros((capacity, NUM_FEATURES), dtype=np.bool_)
        self.num_samples = np.ones(capacity, dtype=np.int64)

    def grow(self, capacity: int) -> None:
        """Room for `capacity` slots; the new ones as a new table's."""
        grown = SamplingTable(capacity)
        old = len(self.num_samples)
        grown.params[:old], grown.features[:old] = self.params, self.features
        grown.num_samples[:old] = self.num_samples
        self.params, self.features, self.num_samples = (
            grown.params,
            grown.features,
            grown.num_samples,
        )

    def set(self, slot: int, params: SamplingParams, num_samples: int) -> None:
        top_k = max(params.top_k, 0)
        self.params[slot] = (params.temperature, top_k, params.top_p, params.min_p)
        self.features[slot] = (
            bool(params.logit_bias),
            params.has_penalties,
            params.min_tokens > 0,
            params.seed is not None,
            params.logprobs is not None,
            top_k > 0 or params.top_p < 1 or params.min_p > 0,
        )
        self.num_samples[slot] = num_samples

    def gather(self, slots: npt.NDArray[np.int64], device: torch.device | str) -> SamplingMetadata:
        """The metadata of the rows held in `slots`, in that order."""
        params = self.params[slots]
        used: list[bool] = np.asarray(self.features[slots].any(axis=0)).tolist()
        greedy = bool((params[:, TEMPERATURE] == 0).all())
        return SamplingMetadata(
            params=None if greedy else to_device(torch.from_numpy(params), device),
            num_samples=self.num_samples[slots],
            any_bias=used[BIAS],
            any_penalties=used[PENALTIES],
            any_min_tokens=used[MIN_TOKENS],
            any_seed=used[SEED],
            any_logprobs=used[LOGPROBS],
            any_filters=used[FILTERS],
        )
