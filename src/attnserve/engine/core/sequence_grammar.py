"""`SequenceGrammar`: one constrained sequence's grammar matcher, and the step's token bitmask.

The matcher follows the sequence's output tokens: `advance` feeds it whatever it has not seen
yet, so it stays right however the tokens came (drawn, or a fork's first token). A fork starts a
matcher of its own at the grammar's start (forks are made when the prompt draws their first
tokens). Preemption keeps a sequence's tokens (recompute computes their cache again, a swap
moves it), so the matcher needs no rollback. For each step with constrained draws,
`token_bitmask` fills the allowed tokens of every constrained sequence that draws, once the
matchers have taken the previous step's tokens (while the step's forward pass runs); the sampler
masks the logits with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnserve.engine.core.grammar import CompiledGrammar, GrammarCache
from attnserve.step_types import TokenBitmask


class SequenceGrammar:
    def __init__(self, cache: GrammarCache, compiled: CompiledGrammar) -> None:
        self.cache = cache
        self.compiled = compiled
        self.matcher = cache.matcher(compiled)
        self.num_accepted = 0  # output tokens the matcher has taken

    def fork(self) -> SequenceGrammar:
        """A matcher of the same grammar at its start, for a fork (which then `advance`s)."""
        return SequenceGrammar(self.cache, self.compiled)

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Feed the matcher the output tokens it has not seen; False when it refuses one."""
        for token in token_ids[num_prompt_tokens + self.num_accepted :]:
            if not self.matcher.accept_token(token):
                return False
            self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """The grammar has been completed and its stop token taken: the output is done."""
        return bool(self.matcher.is_terminated())


def token_bitmask(
    grammars: Sequence[SequenceGrammar | None], pin_memory: bool = False
) -> TokenBitmask | None:
    """The bitmask of one step's sampling sequences (None for an unconstrained one), or None
    when none is constrained; in pinned host memory with `pin_memory`."""
    constrained = [(i, grammar) for i, grammar in enumerate(grammars) if grammar is not None]
    if not constrained:
        return None
    cache = constrained[0][1].cache
    shape = (len(constrained), -(-cache.vocab_size // 32))
    # every word of each row is written by the fill: no initial value (nor torch's threads for it)
    bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin_memory)
    cache.fill_bitmask([grammar.matcher for _, grammar in constrained], bitmask)
    return TokenBitmask([i for i, _ in constrained], bitmask)
