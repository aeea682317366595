"""`loose_whitespace`: what compact JSON (the default of structured outputs) may not have —
whitespace outside strings other than the one space of the separators `", "` and `": "`."""

from __future__ import annotations


def loose_whitespace(text: str) -> list[int]:
    """Where JSON `text` has whitespace outside its strings that is not one space after a `,`
    or a `:`."""
    found = []
    in_string = escaped = False
    for i, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char.isspace() and not (char == " " and text[i - 1 : i] in (",", ":")):
            found.append(i)
    return found
