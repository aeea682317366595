"""The engine core's channel to its front end: the step message's columns round-trip every
field, the core reads commands while a step runs (a burst never blocks the sender), and a
request that arrives while a step runs is in the step scheduled next."""

from __future__ import annotations

import pickle
import threading
from dataclasses import fields
from multiprocessing import Pipe
from typing import Any, TypeVar

from attnserve.engine.core.loop import pipe_emit, pipe_take, run_core
from attnserve.engine.core.messages import (
    PICKLE_PROTOCOL,
    CoreCommand,
    CoreGauges,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
)
from attnserve.sampling_params import SamplingParams

T = TypeVar("T")

GUARD_S = 60.0  # only a broken channel waits this long


def test_step_outputs_round_trip_every_field() -> None:
    outputs = EngineCoreOutputs(
        [
            EngineCoreOutput("a#0", 0, [5]),
            EngineCoreOutput(
                "b#1", 2, [7, 8], [{7: -0.5, 9: -1.25}, {8: -0.1}], -0.6, "stop",
                [{1: -2.0}, {3: -0.25}], 12.5,
            ),
            EngineCoreOutput("c#2", 1, [], finish_reason="abort"),
            EngineCoreOutput("d#3", 0, [11], cumulative_logprob=float("-inf"), scheduled_at=3.0),
        ],
        ["c#2", "z#9"],
        drawn_at=41.5,
        timestamp=42.0,
    )  # fmt: skip
    back = pickle.loads(pickle.dumps(outputs, protocol=PICKLE_PROTOCOL))
    assert back == outputs
    for name in (f.name for f in fields(EngineCoreOutput)):
        assert [getattr(o, name) for o in back.outputs] == [
            getattr(o, name) for o in outputs.outputs
        ], name
    assert pickle.loads(pickle.dumps(EngineCoreOutputs())) == EngineCoreOutputs()


class _RecordingCore:
    """An `EngineCore` stand-in: logs commands and steps; step `block_at` waits for `release`."""

    def __init__(self, block_at: int) -> None:
        self.log: list[str] = []
        self.block_at = block_at
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.waiting: list[str] = []
        self.steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        self.log.append(f"add {request.request_id}")
        self.waiting.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.log.append(f"abort {request_ids}")

    def finish_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.log.append(f"finish {sequences}")

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> EngineCoreOutputs:
        self.steps += 1
        scheduled, self.waiting = self.waiting, []
        self.log.append(f"step {self.steps} schedules {scheduled}")
        if self.steps == self.block_at:
            self.in_step.set()
            assert self.release.wait(GUARD_S)
        return EngineCoreOutputs([EngineCoreOutput(r, 0, [1]) for r in scheduled])

    def stats(self) -> dict[str, float]:
        return {"num_waiting": len(self.waiting), "num_steps": self.steps}

    def shutdown(self) -> None:
        self.log.append("shutdown")


def _request(request_id: str, prompt_len: int = 4) -> tuple[CoreCommand, Any]:
    return CoreCommand.ADD, EngineCoreRequest(request_id, [1] * prompt_len, SamplingParams())


def _serve(core: _RecordingCore) -> tuple[Any, Any, threading.Thread]:
    core_commands, commands = Pipe(duplex=False)
    messages, core_messages = Pipe(duplex=False)
    thread = threading.Thread(
        target=run_core, args=(core, pipe_take(core_commands), pipe_emit(core_messages))
    )
    thread.start()
    return commands, messages, thread


def test_a_request_that_arrives_during_a_step_is_in_the_next_step() -> None:
    core = _RecordingCore(block_at=1)
    commands, messages, thread = _serve(core)
    commands.send_bytes(pickle.dumps(_request("first")))
    assert core.in_step.wait(GUARD_S)  # step 1 runs (and waits) with "first"
    commands.send_bytes(pickle.dumps(_request("late")))
    core.release.set()
    steps = _received(messages, EngineCoreOutputs, 2)
    commands.send_bytes(pickle.dumps((CoreCommand.SHUTDOWN, None)))
    thread.join(GUARD_S)
    assert [[o.request_id for o in step.outputs] for step in steps] == [["first"], ["late"]]
    assert core.log == [
        "add first",
        "step 1 schedules ['first']",
        "add late",
        "step 2 schedules ['late']",
        "shutdown",
    ]


def _received(messages: Any, kind: type[T], count: int) -> list[T]:
    """The next `count` messages of `kind` from the core (the others passed over)."""
    found: list[T] = []
    while len(found) < count:
        assert messages.poll(GUARD_S)
        message = pickle.loads(messages.recv_bytes())
        if isinstance(message, kind):
            found.append(message)
    return found


def test_the_core_pushes_its_gauges_when_it_goes_idle() -> None:
    core = _RecordingCore(block_at=0)
    commands, messages, thread = _serve(core)
    assert _received(messages, CoreGauges, 1)[0].stats == {"num_waiting": 0, "num_steps": 0}
    commands.send_bytes(pickle.dumps(_request("first")))
    _received(messages, EngineCoreOutputs, 1)
    assert _received(messages, CoreGauges, 1)[0].stats == {"num_waiting": 0, "num_steps": 1}
    commands.send_bytes(pickle.dumps((CoreCommand.SHUTDOWN, None)))
    thread.join(GUARD_S)


def test_a_burst_is_read_while_a_step_runs() -> None:
    """Many megabytes of requests (far past a pipe's buffer) go through while the core's step
    is still running: the sender never waits for a step."""
    core = _RecordingCore(block_at=1)
    commands, _, thread = _serve(core)
    commands.send_bytes(pickle.dumps(_request("first")))
    assert core.in_step.wait(GUARD_S)
    sent = threading.Event()

    def burst() -> None:
        for i in range(200):
            commands.send_bytes(pickle.dumps(_request(f"r{i}", prompt_len=8192)))
        sent.set()

    threading.Thread(target=burst, daemon=True).start()
    try:
        assert sent.wait(GUARD_S), "the sender blocked while the core's step ran"
        assert core.steps == 1 and not core.release.is_set()
    finally:
        core.release.set()
        commands.send_bytes(pickle.dumps((CoreCommand.SHUTDOWN, None)))
        thread.join(GUARD_S)
    # The last few messages may still be in the pipe when the step ends: every one is read, in
    # order, whichever step it lands in.
    assert [entry for entry in core.log if entry.startswith("add r")] == [
        f"add r{i}" for i in range(200)
    ]
