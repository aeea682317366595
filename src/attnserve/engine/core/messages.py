"""What crosses between the front end and the engine core (vLLM V1's EngineCore protocol).

The front end (`LLMEngine`, and through it `AsyncLLMEngine` and the server) tokenizes, checks and
sends each request as an `EngineCoreRequest`; the core schedules and runs the model and answers
with ONE `EngineCoreOutputs` per step, carrying every sequence that advanced: the token drawn for
it, its log-probabilities, how it finished. Detokenizing, stop strings and `RequestOutput`s are
the front end's; when it finds a stop string it tells the core to finish that sequence.

Commands to the core are `(CoreCommand, payload)` tuples; the core answers a call with a
`CallReply`, reports once that it is up with `CoreReady` and, when it fails, `CoreFailed`. Over a
process boundary every message is pickled (protocol 5) and sent through a
`multiprocessing.connection` pipe; in a thread the same objects go through queues.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from attnserve.lora.request import LoRARequest
from attnserve.sampling_params import SamplingParams
from attnserve.step_types import TokenLogprobs

PICKLE_PROTOCOL = 5  # of every message over a pipe (out-of-band buffers, fast bytes)
# What a call may ask the core for (methods of `EngineCore` without arguments).
CALLABLE_METHODS = ("stats", "reset_stats")


class CoreCommand(enum.Enum):
    ADD = "add"  # payload: EngineCoreRequest
    ABORT = "abort"  # payload: request ids
    FINISH = "finish"  # payload: (request id, sequence index) pairs, ended by a stop string
    CALL = "call"  # payload: (call id, method name)
    SHUTDOWN = "shutdown"  # payload: None


Command = tuple[CoreCommand, Any]


@dataclass
class EngineCoreRequest:
    """A checked request: `request_id` is the core's own id (unique per `add_request`);
    `priority`: lower runs earlier under the "priority" scheduling policy (vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base)


@dataclass
class EngineCoreOutput:
    """What one sequence got in one step. A parallel-sampling fork first appears with its index;
    `prompt_logprobs` come once, with the first sequence's first token. Built for every
    sequence every step, so a plain dataclass."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # when the request asked for logprobs
    cumulative_logprob: float | None = None  # the sum of the drawn tokens' log-probabilities
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    scheduled_at: float | None = None  # first outputs: when a step first took the request,
    queued_steps: int | None = None  # ... and how many steps the scheduler ran before that


# The fields of `EngineCoreOutput` that most outputs leave at None, sent only where set.
_SPARSE_FIELDS = (
    "new_logprobs", "cumulative_logprob", "finish_reason", "prompt_logprobs", "scheduled_at",
    "queued_steps",
)  # fmt: skip


@dataclass
class EngineCoreOutputs:
    """One step: every sequence that advanced, and the requests the core has ended since its
    last report (all their sequences finished; the core holds nothing of them any more).

    Over a pipe it travels as columns (`__reduce__`): a list of request ids, one of indices, one
    of new-token lists, and the rarer fields only where set — a few pickled lists per step
    instead of a pickled object per sequence."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: list[str] = field(default_factory=list)
    # time.monotonic() (one clock for every process of a host) when the core read these tokens
    # back, and when it handed them over: the front end's latency breakdown starts from them
    drawn_at: float = 0.0
    timestamp: float = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        outputs = self.outputs
        sparse = {
            name: {
                i: value for i, o in enumerate(outputs) if (value := getattr(o, name)) is not None
            }
            for name in _SPARSE_FIELDS
        }
        columns = (
            [o.request_id for o in outputs],
            [o.index for o in outputs],
            [o.new_token_ids for o in outputs],
            {name: values for name, values in sparse.items() if values},
        )
        times = (self.drawn_at, self.timestamp)
        return _from_columns, (columns, self.finished_requests, times)


def _from_columns(
    columns: tuple[list[str], list[int], list[list[int]], dict[str, dict[int, Any]]],
    finished_requests: list[str],
    times: tuple[float, float],
) -> EngineCoreOutputs:
    """`EngineCoreOutputs.__reduce__`'s columns as the step's outputs again."""
    request_ids, indices, new_token_ids, sparse = columns
    outputs = list(map(EngineCoreOutput, request_ids, indices, new_token_ids))
    for name, values in sparse.items():
        for i, value in values.items():
            setattr(outputs[i], name, value)
    return EngineCoreOutputs(outputs, finished_requests, *times)


@dataclass(frozen=True)
class CoreAlive:
    """A core process's heartbeat, sent every `HEARTBEAT_INTERVAL_S` from a thread of its own
    (also while a step runs): its front end declares it hung when none comes for longer than
    its liveness timeout."""


HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class CoreGauges:
    """The core's `stats()`, pushed every `GAUGE_INTERVAL_S` while it steps and each time it
    goes idle: its front end answers `/metrics` from them, never waiting for a step."""

    stats: dict[str, float]


GAUGE_INTERVAL_S = 0.5


@dataclass(frozen=True)
class CoreReady:
    """The core is up: what the front end needs to know of it."""

    kv_cache_tokens: int  # the most tokens one sequence's KV blocks can hold
    pid: int


@dataclass(frozen=True)
class CallReply:
    call_id: int
    result: Any


@dataclass(frozen=True)
class CoreFailed:
    """The core stopped on `error` (kept where it pickles; the core logs its traceback)."""

    message: str
    error: BaseException | None = None

    @classmethod
    def from_error(cls, error: BaseException) -> CoreFailed:
        return cls(f"{type(error).__name__}: {error}", error)


CoreMessage = EngineCoreOutputs | CoreReady | CallReply | CoreFailed | CoreAlive | CoreGauges
