"""Class names as targets: the command line's `--target star` and `explain(..., target="star")` take the same names."""
from __future__ import annotations

import difflib
from typing import Callable, Sequence

from .messages import quoted

#: class names listed in full in an error; longer lists are summarised
LISTED_CLASSES = 20


def named_classes(target: object, class_names: Callable[[], Sequence[str] | None]) -> object:
    """`target` with its class names (a str, or str items of a list or tuple) turned into class indices: a name of
    `class_names()` (case and surrounding spaces ignored; the first of equal names) or a written index ("3"). The
    command line's `--target` is such a string, so both take the same targets; other targets are returned as given."""
    items = [target] if isinstance(target, str) else list(target) if isinstance(target, (list, tuple)) else []
    if not any(isinstance(item, str) for item in items):
        return target
    names = class_names()
    lookup: dict[str, int] = {}
    for index, name in enumerate(names or []):
        lookup.setdefault(str(name).strip().lower(), index)

    def index_of(item: object) -> object:
        if not isinstance(item, str):
            return item
        key = item.strip().lower()
        if key.isdigit():
            return int(key)
        if key in lookup:
            return lookup[key]
        raise ValueError(unknown_class(item, names))

    indices = [index_of(item) for item in items]
    return indices[0] if isinstance(target, str) else indices


def unknown_class(name: str, names: Sequence[str] | None) -> str:
    """A one-line error for a class name the model does not have: its classes (or the closest of many)."""
    shown = quoted(name)
    if not names:
        return f"unknown target {shown}: the model names no classes; give a class index"
    if len(names) <= LISTED_CLASSES:
        return f"unknown target {shown}: the model's classes are {', '.join(f'{n} ({i})' for i, n in enumerate(names))}"
    close = difflib.get_close_matches(name.strip().lower(), [str(n).lower() for n in names], n=3)
    hint = f"; close names: {', '.join(close)}" if close else ""
    return f"unknown target {shown}: not one of the model's {len(names)} class names{hint}"
