"""What the commands share beyond the apps layer (`relevancy.apps`): the output folder, the input limits, the
`--json` output and image files (no torch imported)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable

from ..common import UsageError, warn
from ...core.files import strict_json
from ...core.messages import quoted

if TYPE_CHECKING:
    from PIL import Image

    from ...results.explanation import Explanation

DEFAULT_OUT = "relevancy-out"
#: the most input files one command explains (each is a PNG and part of one batch in memory)
MAX_FILES = 100
#: the most texts (explain-text) or questions (explain-question) one command explains
MAX_TEXTS = 100


def class_target(target: str | None) -> str | None:
    """`--target` as `explain()` takes it (a class index or name, as written); a UsageError for a negative index
    or an empty name."""
    if target is None:
        return None
    text = target.strip()
    if not text or (text.startswith("-") and text[1:].isdigit()):
        raise UsageError(f"--target must be a class index (0 or more) or a class name, got {quoted(target)}")
    return text


def print_json(value: Any) -> None:
    """`value` as strict JSON on stdout (NaN and infinities as null)."""
    print(json.dumps(strict_json(value), allow_nan=False))


def print_results(results: Iterable[Explanation]) -> None:
    """What `--json` prints for the explaining commands: a list of the results' `to_json()` (the schema of
    docs/api.md), one per method run (and per image, where each image is explained alone)."""
    print_json([result.to_json() for result in results])


def read_image(path: str, command: str = "explain") -> Image.Image:
    """An image file as an 8-bit RGB picture (`relevancy.core.pictures.read_image`), its warnings as `command`'s."""
    from ...core.pictures import read_image as read

    return read(path, lambda message: warn(command, message))
