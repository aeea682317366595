"""`ChatTemplateFields`: vLLM's chat-template fields of a chat request (and of a chat-style
/tokenize), as pydantic fields; `chat_template.template_options` checks them together. A leaf of
the protocol modules, like `request_body`."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from attnserve.entrypoints.openai.request_body import RequestBody, Text


class ChatTemplateFields(RequestBody):
    """vLLM's chat-template fields of a chat request (and of a chat-style /tokenize)."""

    add_generation_prompt: bool = Field(True, description="the assistant's header at the end")
    continue_final_message: bool = Field(
        False, description="the last message left open (needs add_generation_prompt: false)"
    )
    chat_template: Text | None = Field(
        None, description="a Jinja template for this request (--trust-request-chat-template)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template (e.g. enable_thinking)"
    )
    documents: list[dict[str, Text]] | None = Field(
        None, description="the template's documents (retrieval-augmented templates)"
    )
