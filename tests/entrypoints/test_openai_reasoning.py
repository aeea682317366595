"""Reasoning output and the chat-template fields against a real server, through the openai SDK
(vLLM's fields in `extra_body`): `--reasoning-parser qwen3` splitting a reply's thinking into
`reasoning_content` (whole and streamed alike), `--chat-template` in place of the model's,
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `documents` and a
request's own `chat_template` reaching the rendered prompt, and the combinations refused by name.

The server is the tiny random chat model; a regex (structured outputs) makes its reply carry
`</think>` (split across several tokens), so the split is checked on real engine output. The
parsers' edge cases (tags cut anywhere, deepseek_r1's reply without `<think>`) are checked on
the parser itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from attnserve import LLM, SamplingParams
from attnserve.cli import build_parser
from attnserve.entrypoints.openai.chat_template import load_chat_template
from attnserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from tests.conftest import HANG_GUARD_S
from tests.entrypoints.openai_server import TINY_MODEL, ServerProcess

# Qwen3-like: the generation prompt opens the thinking, or (enable_thinking false) renders it
# closed and empty; the documents and an assistant's earlier thinking are printed too.
SERVER_TEMPLATE = (
    "[server]{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUESTION = [{"role": "user", "content": "why"}]
THINK_THEN_ANSWER = {"structured_outputs": {"regex": "[a-z]{1,8}</think>[a-z]{1,8}"}}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(SERVER_TEMPLATE)
    args = [str(tiny_chat_model_dir), "--device", "cpu", "--served-model-name", TINY_MODEL]
    args += ["--max-model-len", "256", "--reasoning-parser", "qwen3"]
    args += ["--chat-template", str(template), "--trust-request-chat-template"]
    process = ServerProcess(args)
    yield process
    process.stop()


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=24, temperature=0, extra_body=extra
    )


def _rendered(server: ServerProcess, messages: list[dict[str, Any]], **extra: Any) -> str:
    """The prompt text /tokenize renders for the conversation (its ids decoded)."""
    body = {"model": TINY_MODEL, "messages": messages, **extra}
    tokens = httpx.post(server.url + "/tokenize", json=body, timeout=HANG_GUARD_S).json()
    detokenize = {"model": TINY_MODEL, "tokens": tokens["tokens"]}
    prompt: str = httpx.post(server.url + "/detokenize", json=detokenize).json()["prompt"]
    return prompt


def test_the_thinking_is_split_whole_and_streamed_alike(client: openai.OpenAI) -> None:
    whole = _chat(client, QUESTION, **THINK_THEN_ANSWER).choices[0].message
    assert whole.reasoning_content and whole.content  # type: ignore[attr-defined]
    assert "think>" not in whole.reasoning_content + whole.content  # type: ignore[attr-defined]
    stream = client.chat.completions.create(
        model=TINY_MODEL,
        messages=QUESTION,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
        extra_body=THINK_THEN_ANSWER,
    )
    kinds, thought, content = [], "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning = getattr(choice.delta, "reasoning_content", None)
            thought += reasoning or ""
            content += choice.delta.content or ""
            kinds += ["reasoning"] * bool(reasoning) + ["content"] * bool(choice.delta.content)
    assert (thought, content) == (whole.reasoning_content, whole.content)  # type: ignore[attr-defined]
    assert kinds == sorted(kinds, reverse=True)  # every thinking delta before the content


def test_enable_thinking_false_reaches_the_template(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _rendered(server, QUESTION, **off).endswith("assistant\n<think>\n\n</think>\n\n")
    reply = _chat(client, QUESTION, structured_outputs={"regex": "[a-z]{1,8}"}, **off)
    message = reply.choices[0].message
    assert message.reasoning_content is None and message.content  # type: ignore[attr-defined]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(_tokens(server, QUESTION, **off))


def _tokens(server: ServerProcess, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    body = {"model": TINY_MODEL, "messages": messages, **extra}
    ids: list[int] = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    return ids


def test_the_template_fields_shape_the_prompt(server: ServerProcess, client: openai.OpenAI) -> None:
    draft = [*QUESTION, {"role": "assistant", "content": "because", "reasoning_content": "hm"}]
    assert _rendered(server, QUESTION).startswith("[server]<|im_start|>user")  # --chat-template
    assert _rendered(server, QUESTION, add_generation_prompt=False).endswith("why<|im_end|>\n")
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert _rendered(server, draft, **continued).endswith("<think>hm</think>because")
    documents = [{"title": "Paris", "text": "a city"}]
    assert _rendered(server, QUESTION, documents=documents).startswith("[server][doc Paris]")
    own = {"chat_template": "{{ messages[0].content }}|{{ flavour }}|"}
    prompt = _rendered(server, QUESTION, chat_template_kwargs={"flavour": "mint"}, **own)
    assert prompt == "why|mint|"
    reply = _chat(client, draft, **continued)  # served from the same prompt
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(_tokens(server, draft, **continued))


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        (QUESTION, {"continue_final_message": True}, "continue_final_message"),
        (QUESTION, {"add_generation_prompt": False, "continue_final_message": True},
         "continue_final_message"),
        (QUESTION, {"chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs.add_generation_prompt"),
        (QUESTION, {"chat_template": "{% if %}"}, "chat_template"),
    ],
)  # fmt: skip
def test_refused_combinations_name_the_field(
    client: openai.OpenAI, messages: list[dict[str, Any]], extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, messages, **extra)
    assert error.value.body["param"] == param  # type: ignore[index]


REPLIES = [
    "<think>\nhm</think>\n\nHi",
    "hm</think>Hi",
    "Hello <think>x</think>",
    "  <think>cut sh</th",
    "a</think>b</think>c",
    "<think><think>x</think>y",
    "",
]


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", ["assistant:", "assistant:<think>\n", "<think></think>\n"])
def test_streamed_pieces_split_as_the_whole_reply(parser: str, prompt: str) -> None:
    thinking = REASONING_PARSERS[parser].thinks_first(prompt)
    for reply in REPLIES:
        whole = ReasoningStream(thinking).feed(reply, final=True)
        for size in range(1, 10):
            stream, thought, content = ReasoningStream(thinking), "", ""
            pieces = [reply[i : i + size] for i in range(0, len(reply), size)] or [""]
            for i, piece in enumerate(pieces):
                more = stream.feed(piece, final=i == len(pieces) - 1)
                thought, content = thought + more[0], content + more[1]
            assert (thought, content) == whole, (parser, prompt, reply, size)


@pytest.mark.parametrize(
    ("parser", "prompt", "reply", "split"),
    [
        ("deepseek_r1", "assistant:", "hm</think>Hi", ("hm", "Hi")),  # no <think>: thinking
        ("deepseek_r1", "assistant:", "<think>hm</think>Hi", ("hm", "Hi")),
        ("deepseek_r1", "assistant:", "cut short", ("cut short", "")),
        ("qwen3", "assistant:", "hm</think>Hi", ("", "hm</think>Hi")),  # no <think>: answer
        ("qwen3", "assistant:", "\n<think>hm</think>Hi", ("hm", "Hi")),
        ("qwen3", "assistant:<think>\n", "hm</think>Hi", ("hm", "Hi")),  # opened in the prompt
        ("qwen3", "<think>\n\n</think>\n\n", "Hi <think>", ("", "Hi <think>")),  # thinking off
    ],
)
def test_where_each_parser_starts(
    parser: str, prompt: str, reply: str, split: tuple[str, str]
) -> None:
    thinking = REASONING_PARSERS[parser].thinks_first(prompt)
    assert ReasoningStream(thinking).feed(reply, final=True) == split


def test_an_unknown_reasoning_parser_is_refused_with_the_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nope"])
    error = capsys.readouterr().err
    assert "--reasoning-parser" in error and "deepseek_r1" in error and "qwen3" in error


def test_the_chat_template_flag_takes_a_file_or_the_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ messages }}\\n") == "{{ messages }}\n"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_offline_chat_takes_a_template_and_continues_the_last_message(
    tiny_chat_model_dir: Path,
) -> None:
    llm = LLM(str(tiny_chat_model_dir), device="cpu")
    draft = [*QUESTION, {"role": "assistant", "content": "because"}]
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    params = SamplingParams(max_tokens=1)
    (out,) = llm.chat(draft, params, use_tqdm=False, chat_template=own)
    assert out.prompt == "user: why\nassistant: because\n"
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    (out,) = llm.chat(draft, params, use_tqdm=False, chat_template=own, **continued)
    assert out.prompt == "user: why\nassistant: because"
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(draft, params, use_tqdm=False, continue_final_message=True)
