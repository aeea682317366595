"""Every request field, through the official `openai` client (or raw JSON for what it would not
send) against a real server over a tiny random Llama with the default model's tokenizer (shared
with test_openai_bad_input.py; its greedy text repeats one token: " time time time ..."): the
served fields do what they say,
checked against HF transformers on the same weights where a number is involved; refused fields
and wrong types get a 400 naming them; and no KV block is left in use after all of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import TINY_MODEL, ServerProcess

MODEL = TINY_MODEL
PROMPT = "Once upon a time"
TIME = 655  # " time": what the tiny model repeats after PROMPT
PARIS = 7042  # " Paris"
IM_START = 1  # a special token
NO_EOS: dict[str, Any] = {"ignore_eos": True}
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_chat_server: ServerProcess) -> ServerProcess:
    """The tiny chat model's shared server (tests/entrypoints/conftest.py)."""
    return tiny_chat_server


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir: Path) -> Any:
    """The served model's tokenizer, through transformers."""
    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model_dir: Path) -> Any:
    """HF transformers' model on the served weights (fp32): the reference."""
    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()


def _complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    args.update(kwargs)
    args["extra_body"] = {**NO_EOS, **args.get("extra_body", {})}
    return client.completions.create(**args)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    args.update(kwargs)
    args["extra_body"] = {**NO_EOS, **args.get("extra_body", {})}
    return client.chat.completions.create(**args)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=HANG_GUARD_S)


def test_logit_bias_forces_and_forbids_a_token(client: openai.OpenAI, tokenizer: Any) -> None:
    assert _complete(client).choices[0].text == " time" * 6
    forced = _complete(client, logit_bias={str(PARIS): 100})
    assert forced.choices[0].text == " Paris" * 6
    chat = _chat(client, logit_bias={str(PARIS): 100})
    assert chat.choices[0].message.content == " Paris" * 4
    forbidden = _complete(client, logit_bias={str(TIME): -100}, logprobs=0).choices[0]
    tokens = forbidden.logprobs.tokens
    assert len(tokens) == 6 and " time" not in tokens


def _hf_logprobs(hf_model: Any, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_echo_returns_the_prompt_and_its_logprobs(
    client: openai.OpenAI, tokenizer: Any, hf_model: Any
) -> None:
    plain = _complete(client, logprobs=1).choices[0]
    echoed = _complete(client, echo=True, logprobs=1).choices[0]
    assert echoed.text == PROMPT + plain.text
    ids = tokenizer.encode(PROMPT)
    logprobs = echoed.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids] + plain.logprobs.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    prompt_logprobs = logprobs.token_logprobs[1 : len(ids)]
    assert prompt_logprobs == pytest.approx(_hf_logprobs(hf_model, ids), abs=1e-4)
    assert logprobs.token_logprobs[len(ids) :] == plain.logprobs.token_logprobs
    assert logprobs.text_offset[len(ids)] == len(PROMPT)
    streamed = list(_complete(client, echo=True, logprobs=1, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in streamed) == echoed.text
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == logprobs.tokens
    token_prompt = _complete(client, prompt=ids, echo=True, n=2, max_tokens=2).choices
    assert [c.text for c in token_prompt] == [PROMPT + " time" * 2] * 2


def test_repetition_penalty_changes_the_repetitive_text_as_hf_does(
    client: openai.OpenAI, tokenizer: Any, hf_model: Any
) -> None:
    penalised = _complete(client, max_tokens=12, extra_body={"repetition_penalty": 1.3})
    text = penalised.choices[0].text
    assert text != " time" * 12
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.3,
        )
    assert text == tokenizer.decode(out[0, ids.shape[1] :])


def test_best_of_returns_the_best_by_cumulative_logprob(client: openai.OpenAI) -> None:
    """best_of=4 draws the four candidates n=4 draws with the same seed, and keeps the best."""
    sampled: dict[str, Any] = {"temperature": 1.0, "seed": 5, "logprobs": 0, "max_tokens": 6}
    candidates = _complete(client, n=4, **sampled).choices
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    assert len(set(scores)) == 4
    best = candidates[scores.index(max(scores))].text
    (chosen,) = _complete(client, n=1, best_of=4, **sampled).choices
    assert chosen.text == best
    streamed = list(_complete(client, n=1, best_of=4, stream=True, **sampled))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == best


def test_seed_makes_chat_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        out = _chat(client, n=3, temperature=1.0, seed=seed, max_tokens=8)
        return [c.message.content for c in out.choices]

    first = sample(3)
    assert sample(3) == first and sample(4) != first


def test_stop_token_ids_and_include_stop_str_in_output(client: openai.OpenAI) -> None:
    stopped = _complete(client, extra_body={"stop_token_ids": [TIME]}).choices[0]
    assert (stopped.text, stopped.finish_reason) == ("", "stop")
    extra = {"stop_token_ids": [TIME], "include_stop_str_in_output": True}
    assert _complete(client, extra_body=extra).choices[0].text == " time"
    extra = {"include_stop_str_in_output": True}
    kept = _complete(client, stop=["e t"], extra_body=extra).choices[0]
    assert (kept.text, kept.finish_reason) == (" time t", "stop")
    assert _complete(client, stop=["e t"]).choices[0].text == " tim"


def test_skip_special_tokens(client: openai.OpenAI) -> None:
    forced = {"logit_bias": {str(IM_START): 100}, "max_tokens": 2}
    assert _complete(client, **forced).choices[0].text == ""
    extra = {"skip_special_tokens": False}
    text = _complete(client, **forced, extra_body=extra).choices[0].text
    assert text == "<|im_start|>" * 2


def test_stream_options_continuous_usage_stats(client: openai.OpenAI, tokenizer: Any) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    for create in (_complete, _chat):
        chunks = list(create(client, stream=True, stream_options=options))
        *choices, last = chunks
        assert last.choices == [] and last.usage.completion_tokens > 0
        counts = [c.usage.completion_tokens for c in choices]
        assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens
        assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}


def test_max_completion_tokens_and_user(client: openai.OpenAI) -> None:
    out = _chat(client, max_tokens=10, max_completion_tokens=3, user="alice")
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    assert _complete(client, user="bob", max_tokens=2).usage.completion_tokens == 2


ACCEPTED = [
    {"store": False},
    {"service_tier": "auto"},
    {"modalities": ["text"]},
    {"prompt_cache_key": "k"},
    {"safety_identifier": "u-1"},
    {"suffix": None},
]


@pytest.mark.parametrize("extra", ACCEPTED, ids=str)
def test_fields_that_ask_for_nothing_are_accepted(server: ServerProcess, extra: Any) -> None:
    body = {"messages": CHAT, "max_tokens": 1, **extra}
    assert _post(server, "/v1/chat/completions", body).status_code == 200


COMPLETION = {"prompt": PROMPT, "max_tokens": 1}
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**COMPLETION, "suffix": "The end."}, "suffix"),
    ("/v1/completions", {**COMPLETION, "length_penalty": 0.5}, "length_penalty"),
    ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy"}}, "audio"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content"}}, "prediction"),
    ("/v1/chat/completions", {"messages": CHAT, "web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"messages": CHAT, "metadata": {"a": "b"}}, "metadata"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": CHAT, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}, "function_call"),
    ("/v1/completions", {**COMPLETION, "tools": []}, "tools"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[c[2] for c in REFUSED])
def test_refused_fields_get_a_400_naming_them(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and repr(param) in error["message"]
    assert error["code"] == "unsupported_parameter"


def test_the_openai_client_sees_a_refused_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt=PROMPT, suffix="The end.")


WRONG: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {**COMPLETION, "n": 2.5}, "n"),
    ("/v1/completions", {**COMPLETION, "n": True}, "n"),
    ("/v1/completions", {**COMPLETION, "best_of": 2.5}, "best_of"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "seed": "x"}, "seed"),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "echo": 1}, "echo"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [1.5]}, "stop_token_ids.0"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias.x"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 200}}, "logit_bias.5"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"49152": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions",
     {**COMPLETION, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions",
     {**COMPLETION, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("/v1/completions", {**COMPLETION, "guided_regex": 5}, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["a", 1]}, "guided_choice.1"),
    ("/v1/completions",
     {**COMPLETION, "structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/chat/completions",
     {"messages": CHAT,
      "response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("/v1/chat/completions",
     {"messages": [*CHAT, {"role": "assistant", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": None}]},
     "messages.1.content"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"), WRONG, ids=[f"{c[2]}={list(c[1].values())[-1]}" for c in WRONG]
)
def test_wrong_types_and_values_get_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_no_kv_block_is_left_in_use(server: ServerProcess) -> None:
    assert server.wait_idle()["attnserve:kv_cache_usage_perc"] == 0
