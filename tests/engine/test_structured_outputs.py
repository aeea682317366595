"""Structured outputs in the offline engine, on a tiny random Llama with the default model's
tokenizer (random weights wander anywhere, so only the grammar can make their outputs valid).

Outputs are checked by independent references: `jsonschema` for JSON schemas, Python's `re` for
regexes and grammars, the list itself for choices. Scheduling must not change a constrained
greedy output (chunked prefill, recompute and swap preemption, prefix-cache hits, async
scheduling, the engine core in its own process), the mask must touch only constrained rows, a
bad spec is a ValueError with the compiler's message at submission, and no KV block is left.
JSON is compact unless free whitespace is asked for (on the embedded default model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from attnserve import LLM, SamplingParams, StructuredOutputsParams
from attnserve.engine.core.grammar import grammar_cache
from attnserve.step_types import TokenBitmask
from attnserve.worker.sampler import Sampler
from attnserve.worker.sampling_metadata import SamplingMetadata
from tests.engine.compact_json import loose_whitespace
from tests.entrypoints.openai_server import tiny_model_with_tokenizer
from tests.worker.rows import Row

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
COMPACT_PERSON = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
PROMPTS = ["Describe a person:", "Another one, please, as JSON with a name and an age:", "Hi"]


def constrained(**kwargs: Any) -> SamplingParams:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 48)
    return SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny_structured"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", max_model_len=256)


def _texts(llm: LLM, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def _assert_no_blocks_held(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert core.allocator.num_free_blocks == core.allocator.num_blocks
    assert not core.requests and core.structured_outputs.num_compiling == 0


def test_json_schema_outputs_validate_for_n_and_best_of(llm: LLM) -> None:
    params = [
        constrained(structured_outputs=COMPACT_PERSON),
        constrained(n=2, temperature=1.0, seed=3, structured_outputs=COMPACT_PERSON),
        constrained(best_of=3, temperature=1.0, seed=4, structured_outputs=COMPACT_PERSON),
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    completions = [c for out in outputs for c in out.outputs]
    assert [len(out.outputs) for out in outputs] == [1, 2, 1]
    for completion in completions:
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, PERSON)
        assert completion.text == json.dumps(value)  # no free whitespace: one-line separators
    _assert_no_blocks_held(llm)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,5}-\d{2}"
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    choices = ["yes", "no", 'a "quoted" one']
    params = [
        constrained(structured_outputs=StructuredOutputsParams(regex=regex)),
        constrained(structured_outputs=StructuredOutputsParams(grammar=grammar), max_tokens=200),
        constrained(
            n=3, temperature=1.0, structured_outputs=StructuredOutputsParams(choice=choices)
        ),
    ]
    got = _texts(llm, PROMPTS, params)
    ((text, reason),) = got[0]
    assert re.fullmatch(regex, text) and reason == "stop"
    ((text, reason),) = got[1]
    assert reason in ("stop", "length")
    if reason == "stop":
        assert re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9]))*\)", text)
    else:
        assert re.fullmatch(r"\(([a-c]|x[0-9])(,([a-c]|x[0-9]))*,?x?", text)
    assert all(text in choices and reason == "stop" for text, reason in got[2])


def test_json_object_and_a_schema_cut_by_max_tokens(llm: LLM) -> None:
    anything = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    ((text, reason),) = _texts(llm, PROMPTS[:1], constrained(structured_outputs=anything))[0]
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length" and text.startswith("{")
    cut = constrained(structured_outputs=COMPACT_PERSON, max_tokens=4)
    ((short, reason),) = _texts(llm, PROMPTS[:1], cut)[0]
    start = '{"name": "'  # the schema's only way to begin
    assert reason == "length" and (start.startswith(short) or short.startswith(start))


def test_ignore_eos_still_ends_where_the_grammar_does(llm: LLM) -> None:
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    got = _texts(llm, PROMPTS[:1], constrained(structured_outputs=spec, ignore_eos=True))
    ((text, reason),) = got[0]
    assert text in ("alpha", "beta") and reason == "stop"


def test_the_mask_touches_only_constrained_requests(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _texts(llm, PROMPTS[:1], free)
    mixed = _texts(llm, PROMPTS, [free, constrained(structured_outputs=COMPACT_PERSON), free])
    assert mixed[0] == alone[0]
    jsonschema.validate(json.loads(mixed[1][0][0]), PERSON)


SETUPS = {
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "recompute-preemption": {"kv_cache_memory_bytes": 14 * 4096, "block_size": 4},
    "swap-preemption": {
        "kv_cache_memory_bytes": 14 * 4096,
        "block_size": 4,
        "preemption_mode": "swap",
    },
    "sync-scheduling": {"async_scheduling": False},
    "core-process": {"engine_core_process": True},
}


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_scheduling_changes_no_constrained_output(llm: LLM, model_dir: Path, setup: str) -> None:
    prompts = [p * 3 for p in PROMPTS] * 2
    params = [constrained(structured_outputs=COMPACT_PERSON, max_tokens=40)] * len(prompts)
    expected = _texts(llm, prompts, params)
    other = LLM(str(model_dir), device="cpu", max_model_len=256, **SETUPS[setup])
    try:
        assert _texts(other, prompts, params) == expected
        stats = other.llm_engine.stats()
        if "preemption" in setup:
            assert stats["num_preemptions"] > 0
        assert stats["kv_cache_usage"] == 0
    finally:
        other.llm_engine.shutdown()


def test_speculation_leaves_constrained_sequences_alone(llm: LLM, model_dir: Path) -> None:
    """With n-gram speculation, a batch of constrained and free requests: a constrained
    sequence gets no drafts (each would need the grammar's mask after the drafts before it), so
    no token its mask forbids is ever accepted and its output is a run's without speculation;
    the free ones speculate, their outputs unchanged too."""
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p * 3 for p in PROMPTS]
    params = [constrained(structured_outputs=COMPACT_PERSON, max_tokens=40), free, free]
    expected = _texts(llm, prompts, params)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    other = LLM(str(model_dir), device="cpu", max_model_len=256, speculative_config=ngram)
    try:
        assert _texts(other, prompts, params) == expected
        assert other.llm_engine.stats()["spec_decode_num_drafts"] > 0
        jsonschema.validate(json.loads(expected[0][0][0]), PERSON)
    finally:
        other.llm_engine.shutdown()


def test_prefix_cache_hits_keep_constrained_outputs(llm: LLM) -> None:
    params = constrained(structured_outputs=COMPACT_PERSON)
    first = _texts(llm, PROMPTS, params)
    assert _texts(llm, PROMPTS, params) == first
    assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"regex": "a(b"}, "invalid structured_outputs.regex: Regex parsing error"),
        ({"grammar": "root ::= missing"}, "invalid structured_outputs.grammar: EBNF parser error"),
        ({"json": {"type": "objec"}}, 'invalid structured_outputs.json: Unsupported type "objec"'),
    ],
)
def test_a_bad_spec_is_refused_at_submission(llm: LLM, spec: dict, message: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    _assert_no_blocks_held(llm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
        ({"json_object": "yes"}, "json_object must be a boolean"),
    ],
)
def test_specs_are_checked_up_front(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_min_tokens_with_a_grammar_is_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a"))


def test_a_spec_compiles_once(llm: LLM) -> None:
    cache = grammar_cache(llm.llm_engine.model_config)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"zz": {"type": "null"}}})
    misses = cache.misses
    first = cache.compile(spec)
    same = StructuredOutputsParams(json=json.dumps(spec.json, indent=2))  # same schema as text
    assert cache.compile(same) is first
    assert cache.misses == misses + 1


def _bitmask(allowed: dict[int, list[int]], vocab: int) -> TokenBitmask:
    """xgrammar's packed int32 bitmask allowing, per constrained row, those tokens."""
    bitmask = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int32)
    for k, tokens in enumerate(allowed.values()):
        for token in tokens:
            word = bitmask[k, token // 32].item() | (1 << (token % 32))
            bitmask[k, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return TokenBitmask(list(allowed), bitmask)


def test_the_sampler_masks_constrained_rows_only() -> None:
    torch.manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = {0: [5, 64, 69], 2: [1]}  # rows 0 and 2 constrained
    inputs = [Row(SamplingParams(temperature=0)) for _ in range(3)]
    metadata = SamplingMetadata.from_rows(inputs, "cpu")
    draws = Sampler().draw(logits.clone(), inputs, metadata, _bitmask(allowed, vocab))
    reference = [
        max(allowed[0], key=lambda t: logits[0, t].item()),
        int(logits[1].argmax()),
        1,
    ]
    assert draws.tokens.tolist() == reference
    assert draws.token_logprobs[2].item() == pytest.approx(0.0)  # the only token left


def test_a_bias_or_penalty_cannot_unmask_a_forbidden_token() -> None:
    torch.manual_seed(1)
    vocab = 70
    logits = torch.randn(2, vocab)
    allowed = [5, 64, 69]
    best_forbidden = max(
        (t for t in range(vocab) if t not in allowed), key=lambda t: logits[0, t].item()
    )
    biases = {best_forbidden: 100.0, 64: 0.5}
    params = [
        SamplingParams(temperature=0, logit_bias=biases),
        SamplingParams(temperature=0, logit_bias=biases, repetition_penalty=2.0),
    ]
    inputs = [Row(p, prompt_token_ids=[3], output_token_ids=[5]) for p in params]
    bitmask = _bitmask({0: allowed, 1: allowed}, vocab)
    draws = Sampler().draw(
        logits.clone(), inputs, SamplingMetadata.from_rows(inputs, "cpu"), bitmask
    )
    biased = logits.clone()
    biased[:, 64] += 0.5
    penalised = biased[1, 5].item()
    biased[1, 5] = penalised / 2 if penalised > 0 else penalised * 2
    reference = [max(allowed, key=lambda t: biased[row, t].item()) for row in range(2)]
    assert draws.tokens.tolist() == reference
    allowed_logprobs = torch.log_softmax(biased[:, allowed], dim=-1)
    chosen = [allowed_logprobs[row, allowed.index(t)].item() for row, t in enumerate(reference)]
    assert draws.token_logprobs.tolist() == pytest.approx(chosen, abs=1e-5)


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "country", "population_millions"],
}
ASK_CITY = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def test_json_is_compact_unless_free_whitespace_is_asked_for(default_llm: LLM) -> None:
    """By default no whitespace outside strings but the separators' single spaces (`", "`,
    `": "`): a model cannot pad its JSON up to max_tokens; `disable_any_whitespace=True` is the
    same grammar, `False` lets whitespace through (as a user's reply padded with newlines)."""
    compact = StructuredOutputsParams(json=CITY)
    params = constrained(structured_outputs=compact, max_tokens=80)
    (reply,) = default_llm.chat([ASK_CITY], params, use_tqdm=False)
    text = reply.outputs[0].text
    assert reply.outputs[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CITY)
    assert loose_whitespace(text) == [] and "\n" not in text
    cache = grammar_cache(default_llm.llm_engine.model_config)
    same = StructuredOutputsParams(json=CITY, disable_any_whitespace=True)
    assert cache.compile(same) is cache.compile(compact)
    free = StructuredOutputsParams(json=CITY, disable_any_whitespace=False)
    padded = '{\n  "city": "Paris"\n\n,\n  "country"'
    assert cache.matcher(cache.compile(free)).accept_string(padded)
    assert not cache.matcher(cache.compile(compact)).accept_string(padded)
    params = constrained(structured_outputs=free, max_tokens=80)
    (reply,) = default_llm.chat([ASK_CITY], params, use_tqdm=False)
    if reply.outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.outputs[0].text), CITY)
    else:
        assert reply.outputs[0].text.lstrip().startswith("{")
