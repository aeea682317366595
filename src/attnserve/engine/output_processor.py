"""`OutputProcessor`: the front end's half of every request — the engine core's
`EngineCoreOutputs` in, `RequestOutput`s out, with text and stop strings.

Each `RequestState` keeps, per completion, its tokens, log-probabilities and incrementally
detokenized text. A stop string ends the completion: its text is cut there (before the stop
string, or after it with `include_stop_str_in_output`), later tokens are dropped, and the
sequence is handed back (`ProcessedOutputs.stopped`) for the core to finish. The text of the
EOS or stop token that ended a completion is left out too (kept with that flag), as in vLLM;
the stop string or stop token id is its `stop_reason`. Log-probabilities become `Logprob`
dicts (`engine/logprobs.py`) as they arrive.
Until a completion ends, the last characters that could begin a stop string are held back, so
streamed text never has to be taken back. A request that outputs only once it is finished and
has no stop string to watch for is decoded once, then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from attnserve.engine.core.messages import EngineCoreOutput, EngineCoreOutputs
from attnserve.engine.detokenizer import IncrementalDetokenizer
from attnserve.engine.logprobs import LogprobsBuilder
from attnserve.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
    StepTimings,
)
from attnserve.sampling_params import RequestOutputKind, SamplingParams


class _Completion:
    """One completion as the front end sees it."""

    def __init__(self, index: int, prompt_token_ids: list[int]) -> None:
        self.index = index
        self.token_ids = list(prompt_token_ids)  # prompt, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.logprobs: SampleLogprobs = []
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.ended_by_stop_token = False  # the core ended it on EOS or a stop token id
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""
        self.sent_text = 0  # text and tokens already streamed (DELTA)
        self.sent_tokens = 0
        self.decoded_tokens = 0  # output tokens fed to the detokenizer

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        self.request_id = request_id
        self.submitted = 0.0  # when the front end handed it to the core (time.monotonic())
        self.scheduled = 0.0  # when a core step first took it
        self.queued_steps = 0  # the steps the core's scheduler ran before that
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions: dict[int, _Completion] = {}
        self.num_finished = 0  # completions with a finish reason
        self.prompt_logprobs: PromptLogprobs | None = None
        self.logprobs_builder = LogprobsBuilder(tokenizer)
        self.ended_by_core = False
        self.stop_strings = params.stop_strings
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        # Outputs only once finished (FINAL_ONLY, or best_of pruning); with no stop string to
        # watch for, the core sends each completion once, finished, and its text is decoded then.
        kind, pruning = params.output_kind, params.num_candidates > params.n
        self.final_only = kind is RequestOutputKind.FINAL_ONLY or pruning
        self.text_at_end = params.outputs_only_when_finished

    @property
    def finished(self) -> bool:
        """The core has ended it, or every completion it will have has finished."""
        return self.ended_by_core or self.num_finished == self.params.num_candidates

    def observe(self, out: EngineCoreOutput) -> bool:
        """Take in one sequence's step; True when a stop string has just ended it."""
        completion = self.completions.get(out.index)
        if completion is None:  # the first sequence, or a parallel-sampling fork
            completion = self.completions[out.index] = _Completion(out.index, self.prompt_token_ids)
        elif completion.finished:  # already ended here; the core ran on for a step
            return False
        completion.token_ids += out.new_token_ids
        self._take_logprobs(completion, out)
        if out.cumulative_logprob is not None:
            completion.cumulative_logprob = out.cumulative_logprob
        if out.scheduled_at is not None:
            self.scheduled = out.scheduled_at
        if out.queued_steps is not None:
            self.queued_steps = out.queued_steps
        if out.finish_reason is not None:
            self._finish(completion, out.finish_reason)
            ended_by_token = out.finish_reason == "stop" and bool(out.new_token_ids)
            completion.ended_by_stop_token = ended_by_token
            if ended_by_token and out.new_token_ids[-1] in self.params.stop_token_ids:
                completion.stop_reason = out.new_token_ids[-1]
        if self.tokenizer is None or self.text_at_end:
            return False
        stopped = self._detokenize(completion, self.tokenizer)
        if stopped and not completion.finished:
            self._finish(completion, "stop")
            return True
        return False

    def _take_logprobs(self, completion: _Completion, out: EngineCoreOutput) -> None:
        builder, params = self.logprobs_builder, self.params
        if out.new_logprobs is not None and params.logprobs is not None:
            rows = builder.sample(out.new_logprobs, out.new_token_ids, params.logprobs)
            completion.logprobs += rows
        if out.prompt_logprobs is not None and params.prompt_logprobs is not None:
            ids = self.prompt_token_ids
            self.prompt_logprobs = builder.prompt(out.prompt_logprobs, ids, params.prompt_logprobs)

    def _finish(self, completion: _Completion, reason: str) -> None:
        completion.finish_reason = reason
        self.num_finished += 1

    def _detokenize(self, completion: _Completion, tokenizer: PreTrainedTokenizerBase) -> bool:
        """Decode the new tokens; True when the text now reaches a stop string (cut there:
        before it, or after it with `include_stop_str_in_output`). A stop token's own text is
        left out unless `include_stop_str_in_output`."""
        if completion.detokenizer is None:
            params = self.params
            completion.detokenizer = IncrementalDetokenizer(
                tokenizer,
                self.prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        detokenizer = completion.detokenizer
        include_stop = self.params.include_stop_str_in_output
        end = len(completion.token_ids)
        if completion.ended_by_stop_token and not include_stop:
            end -= 1
        before = len(detokenizer.text)
        first = completion.num_prompt_tokens + completion.decoded_tokens
        detokenizer.step(completion.token_ids[first:end], final=completion.finished)
        completion.decoded_tokens = max(end - completion.num_prompt_tokens, 0)
        text = detokenizer.text
        search_from = max(0, before - self.holdback)
        found = ((text.find(s, search_from), len(s)) for s in self.stop_strings)
        hits = [hit for hit in found if hit[0] >= 0]
        if not hits:
            completion.text = text
            return False
        start, length = min(hits)
        completion.stop_reason = text[start : start + length]
        completion.text = text[: start + length if include_stop else start]
        return True

    def _output(self, completion: _Completion, delta: bool) -> CompletionOutput:
        if self.text_at_end and self.tokenizer is not None:  # all finished: decode it now
            self._detokenize(completion, self.tokenizer)
        text = completion.text
        if not completion.finished and self.holdback:
            text = text[: max(0, len(text) - self.holdback)]
        start = completion.num_prompt_tokens + (completion.sent_tokens if delta else 0)
        tokens = completion.token_ids[start:]
        logprobs = completion.logprobs[completion.sent_tokens :] if delta else completion.logprobs
        sent_text = completion.sent_text
        completion.sent_text = len(text)
        completion.sent_tokens = len(completion.token_ids) - completion.num_prompt_tokens
        if delta:
            text = text[sent_text:]
        return CompletionOutput(
            index=completion.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=completion.cumulative_logprob,
            logprobs=list(logprobs) if self.params.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def output(self) -> RequestOutput | None:
        """This step's output, or None when the output kind has nothing to say yet."""
        finished = self.finished
        if self.final_only and not finished:
            return None
        completions = sorted(self.completions.values(), key=lambda c: c.index)
        if self.params.num_candidates > self.params.n:  # the best n, best first (as vLLM)
            best = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))
            completions = best[: self.params.n]
        delta = self.params.output_kind is RequestOutputKind.DELTA
        outputs = [self._output(c, delta) for c in completions]
        for position, output in enumerate(outputs):
            output.index = position
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=self._prompt_logprobs(),
            submitted=self.submitted,
            scheduled=self.scheduled,
            queued_steps=self.queued_steps,
        )

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        """vLLM's shape: None for the first prompt token (a one-token prompt: just that)."""
        if self.params.prompt_logprobs is None:
            return None
        return self.prompt_logprobs or [None]


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[tuple[str, int]] = field(default_factory=list)  # (core id, index) to finish


class OutputProcessor:
    """Every live request's state, by the core's request id (unique per add)."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}
        self.core_ids: dict[str, str] = {}  # request id -> core id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.core_ids

    def __len__(self) -> int:
        return len(self.states)

    def add_request(self, core_id: str, state: RequestState) -> None:
        self.states[core_id] = state
        self.core_ids[state.request_id] = core_id

    def abort_request(self, request_id: str) -> str | None:
        """Forget a request; its core id, if it was live."""
        core_id = self.core_ids.pop(request_id, None)
        if core_id is not None:
            del self.states[core_id]
        return core_id

    def process_outputs(self, core_outputs: EngineCoreOutputs, taken: float) -> ProcessedOutputs:
        """One core step's outputs as `RequestOutput`s, and the sequences stop strings ended;
        `taken`: when the step came out of the core's channel (time.monotonic())."""
        timings = StepTimings(core_outputs.drawn_at, core_outputs.timestamp, taken)
        processed = ProcessedOutputs()
        advanced: dict[str, RequestState] = {}
        for out in core_outputs.outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted, or ended here while the core ran on
                continue
            if state.observe(out):
                processed.stopped.append((out.request_id, out.index))
            advanced[out.request_id] = state
        for core_id in core_outputs.finished_requests:
            state = self.states.get(core_id)
            if state is not None:
                state.ended_by_core = True
                advanced[core_id] = state
        for core_id, state in advanced.items():
            output = state.output()
            if output is not None:
                output.step_timings = timings
                processed.request_outputs.append(output)
            if state.finished:
                del self.states[core_id]
                del self.core_ids[state.request_id]
        timings.processed = time.monotonic()
        return processed
