"""The counts behind speculative decoding's metrics (`SpecDecodeStats`) and the figures made of
them (`spec_decode_stats`): the engine's stats, /metrics and the benchmarks all read these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnserve.step_types import StepResults

SPEC_DECODE_COUNTS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def spec_decode_stats(
    num_drafts: float, num_draft_tokens: float, num_accepted_tokens: float
) -> dict[str, float]:
    """The counts under their `SPEC_DECODE_COUNTS` names, the share of draft tokens accepted,
    and the mean number of tokens a verified sequence gained per step (the accepted drafts and
    the token drawn after them)."""
    values = (num_drafts, num_draft_tokens, num_accepted_tokens)
    counts = dict(zip(SPEC_DECODE_COUNTS, values, strict=True))
    return counts | {
        "spec_decode_acceptance_rate": num_accepted_tokens / max(num_draft_tokens, 1),
        "spec_decode_mean_acceptance_length": (
            1 + num_accepted_tokens / num_drafts if num_drafts else 0.0
        ),
    }


@dataclass
class SpecDecodeStats:
    """Counts since the engine started (or `reset_stats`): verify steps of one sequence with
    drafts (`num_drafts`), the draft tokens they carried and the ones accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def observe(self, drafts: Sequence[list[int]], results: StepResults) -> None:
        """Record a verify step: each sequence's drafts (none where it carried none, or its
        result no longer counts) and its result, the accepted drafts and one token more."""
        for row_drafts, result in zip(drafts, results, strict=True):
            if row_drafts and result is not None:
                self.record(len(row_drafts), len(result.token_ids) - 1)

    def as_dict(self) -> dict[str, float]:
        return spec_decode_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)
