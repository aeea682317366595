"""`StepFuture`: a launched step's draws, placed back on their rows when read."""

from __future__ import annotations

import torch

from attnserve.step_types import SampleOutput
from attnserve.worker.step_future import StepFuture


def test_device_tokens_go_back_to_their_rows() -> None:
    logprobs = torch.tensor([-0.5, -1.0, -2.0])
    future = StepFuture(4, ([0, 2, 3], torch.tensor([11, 22, 33]), logprobs))
    assert future.result() == [
        SampleOutput([11], token_logprobs=[-0.5]),
        None,
        SampleOutput([22], token_logprobs=[-1.0]),
        SampleOutput([33], token_logprobs=[-2.0]),
    ]
    assert future.result() is future.result()  # read once


def test_ready_results_are_returned_as_given() -> None:
    ready: list[SampleOutput | None] = [None, SampleOutput([1, 2], logprobs=[{1: -0.5}, {2: -1.0}])]
    assert StepFuture(2, ready=ready).result() == ready


def test_a_step_that_draws_nothing_has_no_results() -> None:
    assert StepFuture(3).result() == [None, None, None]
