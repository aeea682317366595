"""Speculative decoding as a user turns it on: `SpeculativeConfig.from_dict` (each mistake named,
the defaults), `LLM(speculative_config=...)` refusing a bad config before any weights load, the
`--speculative-config` JSON flag of `attnserve generate`, and `attnserve serve` with it: the
same greedy text as without speculation, whole and streamed, and its counts on /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from attnserve import LLM, SamplingParams
from attnserve.cli import main
from attnserve.config import SpeculativeConfig
from attnserve.spec_decode import metrics
from attnserve.worker.model_runner import ModelRunner
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import ServerProcess

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# The default model repeats this pattern greedily, so prompt-lookup drafts are accepted; with
# its weights dequantized (fp32) a verify step's logits are a decode step's to ~1e-5.
REPEATS = "one two three four one two three four one two three four one two"
DEFAULT_DEQUANTIZED = ["--device", "cpu", "--max-model-len", "512", "--quantization", "none"]


# SpeculativeConfig.from_dict


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**NGRAM, "lookahead": 2}, "unknown field(s) ['lookahead']"),
        ({**NGRAM, "method": "eagle"}, "method must be one of ('ngram', 'draft_model')"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens must be an int >= 1"),
        ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an int >= 1"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min (3)"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max must be an int >= 1, got 0"),
        ({**NGRAM, "prompt_lookup_min": 0, "prompt_lookup_max": 2}, "prompt_lookup_min must be"),
        ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size must be an int >= 1"),
        ({**NGRAM, "model": "some/draft"}, "speculative_config.model: method 'draft_model'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft model"),
        (
            {"model": "some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max is for method 'ngram' only",
        ),
        ([("method", "ngram")], "speculative_config must be a dict, got list"),
    ],
    ids=lambda value: json.dumps(value) if not isinstance(value, str) else "",
)
def test_a_bad_speculative_config_names_its_field(values: Any, message: str) -> None:
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.from_dict(values)
    assert message in str(error.value)


def test_a_bad_lookup_min_given_alone_is_named() -> None:
    with pytest.raises(ValueError, match=r"prompt_lookup_min must be an int >= 1, got -1"):
        SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": -1})


def test_a_draft_model_implies_its_method() -> None:
    config = SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "m", 2)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['x'\]"):
        SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2, "x": 1})


@pytest.mark.parametrize(
    ("given", "lookup_min", "lookup_max"),
    [
        ({}, 5, 5),
        ({"prompt_lookup_max": 3}, 3, 3),
        ({"prompt_lookup_min": 2}, 2, 2),
        ({"prompt_lookup_min": 2, "prompt_lookup_max": 4}, 2, 4),
        ({"prompt_lookup_min": None, "prompt_lookup_max": 7}, 7, 7),
    ],
)
def test_defaults_of_the_lookup_lengths(
    given: dict[str, int], lookup_min: int, lookup_max: int
) -> None:
    config = SpeculativeConfig.from_dict({"num_speculative_tokens": 4, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (lookup_min, lookup_max)
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert config.disable_by_batch_size == 32


def test_from_dict_leaves_its_argument_alone() -> None:
    values = {"num_speculative_tokens": 2, "prompt_lookup_max": 3}
    SpeculativeConfig.from_dict(values)
    assert values == {"num_speculative_tokens": 2, "prompt_lookup_max": 3}


def test_llm_refuses_a_bad_config_before_loading_weights(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_loading(self: ModelRunner) -> None:
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(ModelRunner, "load_model", no_loading)
    bad = {"method": "nope", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.method must be one of"):
        LLM(str(tiny_llama_dir), device="cpu", speculative_config=bad)
    with pytest.raises(AssertionError, match="the model was loaded"):  # the spy works
        LLM(str(tiny_llama_dir), device="cpu", speculative_config=NGRAM)


def test_a_draft_whose_kv_cache_leaves_no_room_is_refused_by_name(tiny_llama_dir: Path) -> None:
    """A KV budget that holds a block of the target's cache but not one of both caches: the
    target alone starts, with its own model as the draft the error names the draft."""
    model = str(tiny_llama_dir)
    engine = {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 12_000}
    LLM(model, **engine).shutdown()  # a block of 2 layers x K, V x 16 tokens x 2 x 16 fp32: 8 KiB
    draft = {"model": model, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model .*holds no block") as err:
        LLM(model, speculative_config=draft, **engine)
    assert f"'{model}'" in str(err.value)


def test_a_draft_that_does_not_fit_in_memory_is_refused_by_name(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device runs out of memory while the draft loads (after the target): a ValueError
    naming the draft, not torch's error."""
    load_model, loaded = ModelRunner.load_model, []

    def out_of_memory_second(runner: ModelRunner) -> None:
        loaded.append(runner)
        if len(loaded) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        load_model(runner)

    monkeypatch.setattr(ModelRunner, "load_model", out_of_memory_second)
    draft = {"model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model .* does not fit in memory"):
        LLM(str(tiny_llama_dir), device="cpu", speculative_config=draft)
    assert len(loaded) == 2


# attnserve generate --speculative-config


@pytest.fixture
def spec_counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Draft tokens verified and accepted in this test (every engine core in this process)."""
    counts = {"draft": 0, "accepted": 0}
    record = metrics.SpecDecodeStats.record

    def counting(self: metrics.SpecDecodeStats, drafted: int, accepted: int) -> None:
        counts["draft"] += drafted
        counts["accepted"] += accepted
        record(self, drafted, accepted)

    monkeypatch.setattr(metrics.SpecDecodeStats, "record", counting)
    return counts


def _answer(stdout: str) -> str:
    """`attnserve generate`'s output without its last line (the token rate)."""
    lines = stdout.rstrip("\n").split("\n")
    assert lines[-1].startswith("[") and "tokens/s]" in lines[-1]
    return "\n".join(lines[:-1])


def test_generate_with_the_flag_gives_the_greedy_text_of_a_run_without(
    capsys: pytest.CaptureFixture[str], spec_counts: dict[str, int]
) -> None:
    args = ["generate", *DEFAULT_DEQUANTIZED, "--max-tokens", "32", REPEATS]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert spec_counts == {"draft": 0, "accepted": 0}
    assert main([*args[:1], "--speculative-config", json.dumps(NGRAM), *args[1:]]) == 0
    speculative = capsys.readouterr()
    assert spec_counts["accepted"] > 0
    assert _answer(speculative.out) == _answer(plain.out)
    assert REPEATS in plain.out and len(_answer(plain.out)) > len(REPEATS) + 40
    assert speculative.err == plain.err == ""


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 3', "argument --speculative-config: "),
        ("method=ngram", "argument --speculative-config: not valid JSON"),
        ('["ngram", 3]', "argument --speculative-config: a JSON object is needed"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "speculative_config.method must"),
        ('{"method": "ngram"}', "speculative_config.num_speculative_tokens is required"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_code_2(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--model", "llama-tiny", "--load-format", "dummy", "--device", "cpu"]
    try:
        code = main(["generate", *tiny, "--speculative-config", flag, "--prompt-token-ids", "5"])
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


# attnserve serve --speculative-config


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ServerProcess]:
    """`attnserve serve` on the default model (dequantized, CPU, max_model_len 512) with n-gram
    speculation (3 drafts, prompt lookup of 2 to 4 tokens)."""
    spec = {**NGRAM, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    process = ServerProcess([*DEFAULT_DEQUANTIZED, "--speculative-config", json.dumps(spec)])
    yield process
    process.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=spec_server.url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S
    )


def _spec_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The speculative decoding samples of /metrics, without their common prefix."""
    prefix = "attnserve:spec_decode_"
    return {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}


def test_the_server_gives_the_text_of_a_run_without_speculation_whole_and_streamed(
    spec_server: ServerProcess, spec_client: openai.OpenAI, default_llm_dequantized: LLM
) -> None:
    (expected,) = default_llm_dequantized.generate(
        [REPEATS], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )
    model = spec_client.models.list().data[0].id
    request: dict[str, Any] = {"model": model, "prompt": REPEATS, "max_tokens": 32}
    before = _spec_metrics(spec_server.wait_idle())
    assert before == {
        "num_drafts_total": 0,
        "num_draft_tokens_total": 0,
        "num_accepted_tokens_total": 0,
        "acceptance_rate": 0,
        "mean_acceptance_length": 0,
    }
    whole = spec_client.completions.create(**request, temperature=0)
    after = _spec_metrics(spec_server.wait_idle())
    assert whole.choices[0].text == expected.outputs[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 32
    assert 0 < after["num_accepted_tokens_total"] <= after["num_draft_tokens_total"]
    assert after["num_drafts_total"] > 0
    rate = after["num_accepted_tokens_total"] / after["num_draft_tokens_total"]
    assert after["acceptance_rate"] == pytest.approx(rate)
    mean_length = 1 + after["num_accepted_tokens_total"] / after["num_drafts_total"]
    assert after["mean_acceptance_length"] == pytest.approx(mean_length)

    stream = spec_client.completions.create(**request, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # several tokens a step: fewer chunks with text than tokens
    assert len([c for c in chunks if c.choices and c.choices[0].text]) < 32
    idle = spec_server.wait_idle()
    assert _spec_metrics(idle)["num_accepted_tokens_total"] > after["num_accepted_tokens_total"]
    assert idle["attnserve:kv_cache_usage_perc"] == 0


# The first "one two three four one" of the greedy output ends on an accepted draft, with two
# more tokens of the same verify step after it.
STOP = "one two three four one"


def test_the_server_cuts_a_stop_string_amid_a_verify_step(
    spec_client: openai.OpenAI, default_llm_dequantized: LLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, stop=[STOP])
    (expected,) = default_llm_dequantized.generate([REPEATS], params, use_tqdm=False)
    assert expected.outputs[0].finish_reason == "stop"
    model = spec_client.models.list().data[0].id
    request: dict[str, Any] = {
        "model": model, "prompt": REPEATS, "max_tokens": 32, "temperature": 0, "stop": [STOP]
    }  # fmt: skip
    whole = spec_client.completions.create(**request)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (
        expected.outputs[0].text,
        "stop",
    )
    chunks = list(spec_client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text


def test_a_stop_string_amid_a_verify_step_drops_the_tokens_after_it(
    spec_client: openai.OpenAI, default_llm_dequantized: LLM
) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, stop=[STOP])
    (expected,) = default_llm_dequantized.generate([REPEATS], params, use_tqdm=False)
    model = spec_client.models.list().data[0].id
    whole = spec_client.completions.create(
        model=model, prompt=REPEATS, max_tokens=32, temperature=0, stop=[STOP]
    )
    assert whole.usage is not None
    assert whole.usage.completion_tokens == len(expected.outputs[0].token_ids)  # 9, not 7
