"""`RequestBody`, the base of every request body and of its parts (strict types, finite floats,
undeclared fields kept for `request_fields` to judge), and `Text`, a string that must be valid
Unicode. A leaf of the protocol modules: `protocol` and `protocol_structured` build on it."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError("text is not valid Unicode (lone surrogate)") from error
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class RequestBody(BaseModel):
    """A request body or a part of one: strict types, finite floats; undeclared fields kept."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
