"""vLLM's Python shapes on the tiny chat model (a random Llama with the default model's
tokenizer): `Logprob` objects with ranks and texts, `stop_reason`, `TextPrompt` /
`TokensPrompt` dicts, `LLM.chat`'s `tools` and `chat_template_kwargs`, the terminal chat's
mark on a cut reply, and no nanobind leak report when a script ends."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from attnserve import LLM, Logprob, SamplingParams, TextPrompt, TokensPrompt
from attnserve.entrypoints.chat import chat_loop
from tests.conftest import HANG_GUARD_S

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_chat_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_chat_model_dir), device="cpu", max_model_len=64)
    yield llm
    llm.shutdown()


def test_logprobs_are_logprob_objects_with_ranks_and_texts(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(TEXT, SamplingParams(**{**vars(params), "prompt_logprobs": 2}))
    decode = llm.get_tokenizer().decode
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(entry)) == token and isinstance(entry[token], Logprob)
        assert entry[token].rank == 1  # greedy: the likeliest
        assert sorted(lp.rank or 0 for lp in entry.values()) == [1, 2, 3]
        assert all(lp.decoded_token == decode([t]) for t, lp in entry.items())
        values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0)]
        assert values == sorted(values, reverse=True)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for token, prompt_entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert prompt_entry is not None and next(iter(prompt_entry)) == token
        chosen = prompt_entry[token]
        assert chosen.rank is None or chosen.rank <= 2  # outside the top 2: not known
        assert chosen.decoded_token == decode([token]) and chosen.logprob <= 0


def test_stop_reason_names_the_stop_string_or_token(llm: LLM) -> None:
    (plain,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    tokens, text = plain.outputs[0].token_ids, plain.outputs[0].text
    assert plain.outputs[0].finish_reason == "length" and plain.outputs[0].stop_reason is None
    by_token = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[2]])
    stop_string = text[len(text) // 2 :][:2]
    by_string = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop_string])
    token_out, string_out = llm.generate([TEXT, TEXT], [by_token, by_string], use_tqdm=False)
    assert token_out.outputs[0].finish_reason == "stop"
    assert token_out.outputs[0].stop_reason == tokens[2]
    assert string_out.outputs[0].finish_reason == "stop"
    assert string_out.outputs[0].stop_reason == stop_string


def test_prompt_dicts_as_vllm_takes_them(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(TEXT)
    text_prompt: TextPrompt = {"prompt": TEXT}
    tokens_prompt: TokensPrompt = {"prompt_token_ids": ids}
    outputs = llm.generate([text_prompt, tokens_prompt, TEXT, ids], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt for o in outputs] == [TEXT, None, TEXT, None]
    (single,) = llm.generate(tokens_prompt, GREEDY, use_tqdm=False)  # one dict, not a list
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for bad, named in [
        ({"prompt": TEXT, "multi_modal_data": {}}, "multi_modal_data"),
        ({"prompt": TEXT, "prompt_token_ids": ids}, "prompt_token_ids"),
        ({"prompt_token_ids": TEXT}, "prompt_token_ids must be a list"),
    ]:
        with pytest.raises(ValueError, match=named):
            llm.generate(bad, GREEDY, use_tqdm=False)  # type: ignore[arg-type]


def test_chat_renders_tools_and_template_kwargs(llm: LLM) -> None:
    template = (
        "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
        "{% if enable_thinking %}think\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(
        messages,
        GREEDY,
        use_tqdm=False,
        chat_template=template,
        tools=[tool],
        chat_template_kwargs={"enable_thinking": True},
    )
    assert out.prompt == "tool get_weather\nthink\nuser: hi\n"
    (plain,) = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    assert plain.prompt == "user: hi\n"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(messages, GREEDY, continue_final_message=True)


@pytest.mark.parametrize(
    ("max_tokens", "mark"),
    [(3, " [cut at 3 tokens: --max-tokens to raise]"), (None, "fills the context; /reset]")],
)
def test_the_terminal_chat_marks_a_cut_reply(llm: LLM, max_tokens: int | None, mark: str) -> None:
    """`attnserve chat` answers up to the context by default; a reply a limit cut says so."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = io.StringIO()
    lines = ["hi"]

    def read(prompt: str) -> str:
        if not lines:
            raise EOFError
        return lines.pop()

    chat_loop(llm.llm_engine, params, "tiny", read, out=out)
    reply = out.getvalue().split("model> ", 1)[1]
    assert reply.rstrip("\n").endswith(mark)  # after the reply's text (newlines on a random model)


def test_no_nanobind_leak_report_at_exit() -> None:
    """Triton's kernels imported (as the backend report does on any device) and the start-up
    objects frozen as an engine freezes them: the interpreter's exit says nothing of leaks."""
    script = (
        "import attnserve.attention.ops.triton_cache\n"
        "from attnserve.engine.startup_gc import freeze_startup_objects\n"
        "freeze_startup_objects()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert run.returncode == 0, run.stderr
    assert "nanobind" not in run.stderr
