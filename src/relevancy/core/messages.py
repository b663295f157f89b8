"""Pieces of one-line error messages: what a user typed, quoted and shortened, so that an error about a
10,000-word caption stays one readable line."""
from __future__ import annotations

#: the most characters of a user's text quoted in an error
QUOTED_CHARS = 60


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """`repr(value)`, cut to `limit` characters with "..." and the full length when longer."""
    text = repr(value)
    length = len(value) if isinstance(value, str) else len(text)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({length:,} characters)"
