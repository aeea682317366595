"""The terminal chat: a conversation with the model, replies streamed as they are generated."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from typing import TextIO

from attnserve.engine.llm_engine import LLMEngine
from attnserve.sampling_params import SamplingParams


def stream_reply(
    engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams, out: TextIO
) -> str:
    """Generate one reply, writing text to `out` as it arrives; return the whole reply."""
    engine.add_request(request_id, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                new = output.outputs[0].text
                out.write(new[len(text) :])
                out.flush()
                text = new
    out.write("\n")
    return text


def chat_loop(
    engine: LLMEngine,
    params: SamplingParams,
    lines: Iterable[str],
    system: str | None = None,
    out: TextIO = sys.stdout,
) -> None:
    """Read user turns from `lines` until it ends or a line is /quit; keep the history."""
    tokenizer = engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template")
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    reader = iter(lines)
    for turn in itertools.count():
        out.write("you> ")
        out.flush()
        line = next(reader, None)
        if line is None or line.strip() == "/quit":
            return
        history.append({"role": "user", "content": line.strip()})
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        out.write("model> ")
        reply = stream_reply(engine, f"chat-{turn}", str(prompt), params, out)
        history.append({"role": "assistant", "content": reply})
