"""`StructuredOutputManager`: the engine core's side of structured outputs.

A constrained request waits here, outside the scheduler, until its grammar is compiled (on the
`GrammarCache`'s threads, so steps go on meanwhile; a spec compiled before is ready at once), then
enters the scheduler with its matcher. After each step's tokens are in place, `advance` feeds
them to the matchers and names the sequences the grammar ends: a terminated matcher ends its
sequence with "stop" (also under `ignore_eos`); a token the matcher refuses (never drawn under
its mask, so a bug) ends it with "abort". A grammar that cannot be finished within `max_tokens`
ends with "length", as any sequence does.

`token_bitmask` fills the mask of a launched step's draws from the matchers as the step before
left them (the pipeline reads that step back while the new one's forward pass runs). A sequence
that step finished still has a row in the new step: it draws unconstrained, its token dropped,
and its matcher is never asked again. With `pin_memory` (a CUDA rank in this process) the mask
is filled in pinned host memory: its copy to the device is then queued behind the forward pass,
where a pageable copy of that size (rows x vocabulary / 8 bytes) would block the host until the
device reaches it.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait

from attnserve.config.structured_outputs import StructuredOutputsConfig
from attnserve.engine.core.grammar import (
    CompiledGrammar,
    GrammarCache,
    grammar_cache,
    mark_core_process,
)
from attnserve.engine.core.sequence import Sequence
from attnserve.engine.core.sequence_grammar import SequenceGrammar, token_bitmask
from attnserve.model.config import ModelConfig
from attnserve.output_constraints import StructuredOutputsParams
from attnserve.step_types import TokenBitmask

logger = logging.getLogger(__name__)

# An idle core waits this long at most for a compile, then looks at its commands (aborts) again.
COMPILE_WAIT_S = 0.05


class StructuredOutputManager:
    def __init__(
        self,
        model_config: ModelConfig,
        pin_memory: bool = False,
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.model_config = model_config
        self.pin_memory = pin_memory
        self.config = config
        self._cache: GrammarCache | None = None
        mark_core_process(model_config, config)  # a front end here: its checks feed this core
        self._compiling: list[tuple[Sequence, Future[CompiledGrammar]]] = []

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self._cache = grammar_cache(self.model_config, config=self.config)
        return self._cache

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def submit(self, seq: Sequence, spec: StructuredOutputsParams) -> None:
        """Start compiling `seq`'s grammar (or find it compiled); `take_ready` hands it back."""
        self._compiling.append((seq, self.cache.compile_async(spec)))

    def take_ready(self, block: bool) -> list[Sequence]:
        """The sequences whose grammar is compiled now, each with its matcher (or finished with
        "abort" where the compile failed); with `block`, wait a little for one."""
        if block and self._compiling:
            futures = [future for _, future in self._compiling]
            wait(futures, timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        ready = [(seq, future) for seq, future in self._compiling if future.done()]
        self._compiling = [(seq, future) for seq, future in self._compiling if not future.done()]
        for seq, future in ready:
            error = CancelledError() if future.cancelled() else future.exception()
            if error is None:
                seq.grammar = SequenceGrammar(self.cache, future.result())
            else:  # the front end compiled it before sending: not expected here
                logger.error("request %s: its grammar failed to compile: %s", seq.request_id, error)
                seq.finish("abort")
        return [seq for seq, _ in ready]

    @staticmethod
    def advance(seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        """Feed each unfinished constrained sequence's new tokens to its matcher; the
        sequences the grammar ends, with their finish reason. A sequence finished (here or
        before) lets its matcher go: a compiled grammar the cache does not keep is freed with
        its last request, not with the next step."""
        ended = []
        for seq in seqs:
            grammar = seq.grammar
            if grammar is None:
                continue
            reason = None if seq.is_finished else _end_reason(seq, grammar)
            if reason is not None:
                ended.append((seq, reason))
            if seq.is_finished or reason is not None:
                seq.grammar = None  # never asked again: its compiled grammar may go now
        return ended

    def token_bitmask(self, drawing: list[Sequence]) -> TokenBitmask | None:
        """The bitmask of a step's draws (`drawing`: its sampling sequences, in order) from
        the matchers as they are now, or None when no unfinished one is constrained."""
        grammars = [None if seq.is_finished else seq.grammar for seq in drawing]
        return token_bitmask(grammars, self.pin_memory)


def _end_reason(seq: Sequence, grammar: SequenceGrammar) -> str | None:
    """Feed the matcher `seq`'s new tokens: "abort" for a token it refuses, "stop" once the
    grammar is complete, else None."""
    if not grammar.advance(seq.token_ids, seq.num_prompt_tokens):
        logger.error("request %s: a token outside its grammar", seq.request_id)
        return "abort"
    return "stop" if grammar.terminated else None
