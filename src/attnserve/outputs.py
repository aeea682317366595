"""What generation returns: `RequestOutput`, one `CompletionOutput` per sample (vLLM names),
with log-probabilities as `Logprob` objects (vLLM's `SampleLogprobs` / `PromptLogprobs`).

`RequestOutput.merged` joins successive DELTA outputs of one request into one (what a streaming
consumer that fell behind receives). `StepTimings` say when the step behind an output passed each
stage on its way out (the server's latency breakdown).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, its rank in the vocabulary (1: the likeliest; None where not
    known: a drawn token outside the top k asked for) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: the drawn token's, then the top k
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass
class CompletionOutput:
    """`stop_reason`: the stop string or stop token id that ended it (None: EOS, length, or
    not finished)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def joined(parts: Sequence[CompletionOutput]) -> CompletionOutput:
        """Successive DELTA outputs of one completion as one."""
        last = parts[-1]
        logprobs = None
        if all(p.logprobs is not None for p in parts):
            logprobs = [entry for p in parts for entry in p.logprobs or ()]
        return CompletionOutput(
            index=last.index,
            text="".join(p.text for p in parts),
            token_ids=[token for p in parts for token in p.token_ids],
            cumulative_logprob=last.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        )


@dataclass
class StepTimings:
    """When the engine step that drew an output's (first) new tokens passed each stage, in
    `time.monotonic()` seconds (one clock for every process of a host; 0.0: not known). One
    object per step, shared by every output of it."""

    drawn: float = 0.0  # the core read the step's tokens back
    handed_back: float = 0.0  # the core sent the step's outputs
    taken: float = 0.0  # the front end took them from the core's channel
    processed: float = 0.0  # the front end detokenized them and built the outputs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    # the stages of the step that drew this output's (first) new tokens; None where not known
    step_timings: StepTimings | None = None
    submitted: float = 0.0  # time.monotonic() when the front end handed the request to the core
    scheduled: float = 0.0  # ... and when a core step first took it (0.0: not yet, or unknown)
    queued_steps: int = 0  # the steps the core's scheduler ran between the two

    @staticmethod
    def merged(outputs: Sequence[RequestOutput]) -> RequestOutput:
        """Successive DELTA outputs of one request as one (the first one if it is alone)."""
        if len(outputs) == 1:
            return outputs[0]
        parts: dict[int, list[CompletionOutput]] = {}
        for output in outputs:
            for completion in output.outputs:
                parts.setdefault(completion.index, []).append(completion)
        first, last = outputs[0], outputs[-1]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[CompletionOutput.joined(parts[index]) for index in sorted(parts)],
            finished=last.finished,
            prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs), None),
            step_timings=first.step_timings,
            submitted=first.submitted,
            scheduled=first.scheduled,
            queued_steps=first.queued_steps,
        )
