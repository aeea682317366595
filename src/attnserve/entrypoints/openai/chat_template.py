"""The chat template's fields and flags, with vLLM's names and meaning: a chat request's
`chat_template` (a Jinja template of its own, behind `--trust-request-chat-template`),
`chat_template_kwargs` (variables for the template, e.g. Qwen3's `enable_thinking`),
`add_generation_prompt` (default true), `continue_final_message` (default false; the last message,
the assistant's, left open to be continued) and `documents` (the template's `documents`); and
`--chat-template` (a file, or the template itself), the server's template in place of the model's.

`template_options` checks a request's fields (a 400 naming the field) and gives the
`TemplateOptions` that `serving_chat.render_messages` renders with; the fields themselves are in
`protocol_chat_template`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnserve.entrypoints.openai.errors import ApiError
from attnserve.entrypoints.openai.protocol_chat_template import ChatTemplateFields

# apply_chat_template's own arguments, and the request's own fields: never template variables
RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)
REQUEST_FIELDS = frozenset(
    {"tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message"}
)
NOT_BOTH = (
    "continue_final_message and add_generation_prompt cannot both be true "
    "(add_generation_prompt defaults to true: send false with continue_final_message)"
)
UNTRUSTED = (
    "a request's chat_template is refused: this server was not started with "
    "--trust-request-chat-template"
)


@dataclass(frozen=True)
class TemplateOptions:
    """How a conversation is rendered: apply_chat_template's arguments beyond the messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # None: the tokenizer's (the model's, or --chat-template)
    documents: list[dict[str, str]] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # the template's extra variables


def template_options(
    request: ChatTemplateFields, last_role: str | None, trust_request_chat_template: bool
) -> TemplateOptions:
    """The request's `TemplateOptions`; `last_role`: its last message's role. 400 naming the
    field for both add_generation_prompt and continue_final_message, continuing a message that
    is not the assistant's, a reserved template variable, or an untrusted chat_template."""
    if request.continue_final_message and request.add_generation_prompt:
        raise ApiError(400, NOT_BOTH, "continue_final_message")
    if request.continue_final_message and last_role != "assistant":
        message = "continue_final_message needs the last message to be the assistant's"
        raise ApiError(400, f"{message}, not {last_role!r}'s", "continue_final_message")
    if request.chat_template is not None and not trust_request_chat_template:
        raise ApiError(400, UNTRUSTED, "chat_template")
    kwargs = request.chat_template_kwargs or {}
    for name in kwargs:
        if name in RENDER_ARGUMENTS or name in REQUEST_FIELDS:
            why = "the request's own field" if name in REQUEST_FIELDS else "fixed by the server"
            message = f"{name!r} is not a template variable ({why})"
            raise ApiError(400, message, f"chat_template_kwargs.{name}")
    return TemplateOptions(
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        chat_template=request.chat_template,
        documents=request.documents,
        kwargs=dict(kwargs),
    )


def load_chat_template(value: str) -> str:
    """`--chat-template`: the file it names, else (when it looks like a template: it has braces
    or a line break) the template itself, with `\\n` and `\\t` read as a line break and a tab.
    ValueError for what is neither."""
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read "
                f"({error.strerror})"
            ) from None
    return value.replace("\\n", "\n").replace("\\t", "\t")


def use_chat_template(tokenizer: Any, value: str | None) -> None:
    """`--chat-template` (`value`; None: the model's own) as the tokenizer's chat template, so
    every chat request, /tokenize and the tool-call format's detection use it; ValueError when
    it cannot be read or the model has no tokenizer."""
    if value is None:
        return
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer: this model has none (dummy weights)")
    tokenizer.chat_template = load_chat_template(value)
