"""`SamplingParams` checks every field's type and range up front: a ValueError naming the field,
never a TypeError (or a failure deep in the engine) later; what passes survives a pickle."""

from __future__ import annotations

import pickle
import re

import pytest

from attnserve.output_constraints import StructuredOutputsParams
from attnserve.sampling_params import RequestOutputKind, SamplingParams

BAD_FIELDS: list[tuple[dict[str, object], str]] = [
    ({"n": 2.5}, "n must be of type int"),
    ({"n": True}, "n must be of type int"),
    ({"best_of": 2.5}, "best_of must be of type int | None"),
    ({"logprobs": True}, "logprobs must be of type int | None"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs must be of type int | None"),
    ({"seed": "x"}, "seed must be of type int | None"),
    ({"max_tokens": 1.5}, "max_tokens must be of type int | None"),
    ({"min_tokens": "3"}, "min_tokens must be of type int"),
    ({"top_k": 2.0}, "top_k must be of type int"),
    ({"temperature": "hot"}, "temperature must be of type float"),
    ({"temperature": float("nan")}, "temperature must be of type float"),
    ({"top_p": None}, "top_p must be of type float"),
    ({"repetition_penalty": False}, "repetition_penalty must be of type float"),
    ({"ignore_eos": 1}, "ignore_eos must be of type bool"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be of type bool"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output must be of type bool"),
    ({"stop": 3}, "stop must be of type str | list"),
    ({"stop": ["a", 1]}, "stop must be of type str | list"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids must be of type list"),
    ({"stop_token_ids": (2,)}, "stop_token_ids must be of type list"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias must be of type dict"),
    ({"logit_bias": {5: "up"}}, "logit_bias must be of type dict"),
    ({"output_kind": "delta"}, "output_kind must be of type RequestOutputKind"),
    (
        {"structured_outputs": {"regex": "a"}},
        "structured_outputs must be of type StructuredOutputsParams | None",
    ),
    # ranges
    ({"n": 0}, "n must be >= 1"),
    ({"n": 3, "best_of": 2}, "best_of must be >= n"),
    ({"logit_bias": {5: 100.5}}, "logit_bias values must be in -100..100"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be >= 0"),
    ({"logprobs": -1}, "logprobs must be >= 0"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_FIELDS, ids=str)
def test_a_bad_field_is_a_value_error_naming_it(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_good_values_pass_and_survive_a_pickle() -> None:
    params = SamplingParams(
        n=2,
        best_of=3,
        temperature=1,  # an int where a float goes: held as a float
        seed=2**63,
        stop="end",
        stop_token_ids=[7],
        logit_bias={5: -100, 9: 2.5},
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    assert isinstance(params.temperature, float) and params.stop == ["end"]
    assert pickle.loads(pickle.dumps(params)) == params
