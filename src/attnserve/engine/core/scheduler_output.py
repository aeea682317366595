"""What the scheduler decides for one step (`SchedulerOutput`): the sequences it runs and how many
new tokens each computes (`ScheduledSequence`), the block moves before the step, the sequences
it ended itself, and those the ranks propose drafts for after it (speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnserve.engine.core.sequence import Sequence
from attnserve.step_types import BlockPairs, is_prefill


@dataclass(init=False)  # not frozen: one is built per scheduled sequence per step
class ScheduledSequence:
    """A sequence and how many new tokens it computes this step, of which the last
    `len(spec_token_ids)` are draft tokens to verify (speculative decoding). `samples` and
    `is_prefill` are fixed when it is scheduled (they describe the step, not the sequence's
    later state); a step with drafts is a prefill to the attention layers (a query of several
    tokens)."""

    seq: Sequence
    num_new_tokens: int
    spec_token_ids: list[int]
    samples: bool  # the step reaches the sequence's last token, so a next token is drawn
    is_prefill: bool

    def __init__(
        self, seq: Sequence, num_new_tokens: int, spec_token_ids: list[int] | None = None
    ) -> None:
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.spec_token_ids = spec_token_ids or []
        computed = seq.num_computed_tokens
        self.samples = computed + num_new_tokens - len(self.spec_token_ids) == seq.num_tokens
        self.is_prefill = is_prefill(num_new_tokens, computed)

    @property
    def num_target_tokens(self) -> int:
        """The new tokens that are the sequence's own (not drafts)."""
        return self.num_new_tokens - len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    swap_in: BlockPairs = field(default_factory=list)  # (host block, device block)
    swap_out: BlockPairs = field(default_factory=list)  # (device block, host block)
    copies: BlockPairs = field(default_factory=list)  # (device src, device dst)
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler itself
    draft_seq_ids: list[int] = field(default_factory=list)  # the ranks propose drafts for these
