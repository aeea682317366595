"""What generation returns: `RequestOutput`, one `CompletionOutput` per sample (vLLM names).

`RequestOutput.merge` joins two successive DELTA outputs of one request into one (what a
streaming consumer that fell behind receives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from attnserve.core import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, following: CompletionOutput) -> None:
        """Append the DELTA output that follows this one."""
        self.text += following.text
        self.token_ids = self.token_ids + following.token_ids
        if self.logprobs is not None and following.logprobs is not None:
            self.logprobs = self.logprobs + following.logprobs
        self.cumulative_logprob = following.cumulative_logprob
        self.finish_reason = following.finish_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def merge(self, following: RequestOutput) -> RequestOutput:
        """This DELTA output and the one that follows it, as one output (a new object)."""
        completions = {c.index: dataclasses.replace(c) for c in self.outputs}
        for completion in following.outputs:
            if completion.index in completions:
                completions[completion.index].extend(completion)
            else:
                completions[completion.index] = dataclasses.replace(completion)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completions[index] for index in sorted(completions)],
            finished=following.finished,
            prompt_logprobs=self.prompt_logprobs or following.prompt_logprobs,
        )
