"""`Request`: one request's completions, their text (stop strings applied) and its outputs.

Text is detokenized incrementally per completion. A stop string ends the completion and is cut
from its text; until a completion ends, the last characters that could begin a stop string are
held back, so streamed text never has to be taken back. A request that outputs only once it is
finished and has no stop string to watch for is decoded once, then.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.engine.sequence import Sequence
from attnserve.outputs import CompletionOutput, RequestOutput
from attnserve.sampling_params import RequestOutputKind, SamplingParams


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        first: Sequence,
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params: SamplingParams = first.sampling_params
        self.seqs: dict[int, Sequence] = {first.index: first}
        self.tokenizer = tokenizer
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.texts: dict[int, str] = {}
        self.sent: dict[int, tuple[int, int]] = {}  # text and token counts already streamed
        self.stop_strings = self.params.stop_strings
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        # Outputs only once finished (FINAL_ONLY, or best_of pruning); with no stop string to
        # watch for, the text is then decoded once, at the end, rather than token by token.
        kind, pruning = self.params.output_kind, self.params.num_candidates > self.params.n
        self.final_only = kind is RequestOutputKind.FINAL_ONLY or pruning
        self.text_at_end = self.final_only and not self.stop_strings

    @property
    def first(self) -> Sequence:
        return self.seqs[0]

    @property
    def finished(self) -> bool:
        return self.first.num_forks_pending == 0 and all(s.is_finished for s in self.seqs.values())

    def observe(self, seq: Sequence) -> bool:
        """Take in `seq`'s new tokens; True when its text now ends at a stop string."""
        self.seqs[seq.index] = seq
        if self.tokenizer is None or self.text_at_end:
            return False
        detokenizer = self._detokenizer(seq, self.tokenizer)
        before = len(detokenizer.text)
        detokenizer.step(seq.token_ids, final=seq.is_finished)
        text = detokenizer.text
        search_from = max(0, before - self.holdback)
        hits = [i for i in (text.find(s, search_from) for s in self.stop_strings) if i >= 0]
        self.texts[seq.index] = text[: min(hits)] if hits else text
        return bool(hits)

    def _detokenizer(
        self, seq: Sequence, tokenizer: PreTrainedTokenizerBase
    ) -> IncrementalDetokenizer:
        detokenizer = self.detokenizers.get(seq.index)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(
                tokenizer, seq.prompt_token_ids, self.params.skip_special_tokens
            )
            self.detokenizers[seq.index] = detokenizer
        return detokenizer

    def _completion(self, seq: Sequence, delta: bool) -> CompletionOutput:
        if self.text_at_end and self.tokenizer is not None:  # all finished: decode it now
            detokenizer = self._detokenizer(seq, self.tokenizer)
            detokenizer.step(seq.token_ids, final=seq.is_finished)
            self.texts[seq.index] = detokenizer.text
        text = self.texts.get(seq.index, "")
        if not seq.is_finished and self.holdback:
            text = text[: max(0, len(text) - self.holdback)]
        tokens, logprobs = seq.output_token_ids, seq.logprobs
        sent_text, sent_tokens = self.sent.get(seq.index, (0, 0))
        self.sent[seq.index] = (len(text), len(tokens))
        if delta:
            text, tokens = text[sent_text:], tokens[sent_tokens:]
            logprobs = logprobs[sent_tokens:]
        wants_logprobs = self.params.logprobs is not None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(logprobs) if wants_logprobs else None,
            finish_reason=seq.finish_reason,
        )

    def output(self) -> RequestOutput | None:
        """This step's output, or None when the output kind has nothing to say yet."""
        if self.final_only and not self.finished:
            return None
        seqs = sorted(self.seqs.values(), key=lambda s: s.index)
        if self.params.num_candidates > self.params.n:  # keep the best n
            best = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: self.params.n]
            seqs = sorted(best, key=lambda s: s.index)
        delta = self.params.output_kind is RequestOutputKind.DELTA
        completions = [self._completion(seq, delta) for seq in seqs]
        for position, completion in enumerate(completions):
            completion.index = position
        prompt_logprobs = self.first.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.first.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            prompt_logprobs=[None, *prompt_logprobs]
            if self.params.prompt_logprobs is not None
            else None,
        )
