"""What every command shares: usage errors, warnings, JSON output, method names (no torch imported)."""
from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Sequence

from ..files import strict_json
from ..messages import quoted

if TYPE_CHECKING:
    from PIL import Image

    from ..explanation import Explanation

#: the methods of the image models `relevancy explain` takes (`TimmViTAdapter.methods`, `HFViTAdapter.methods`),
#: named here so that the help loads no torch; a test keeps them equal to the registry's
METHOD_NAMES = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution",
                "partial_lrp", "lrp", "cdam", "token_ablation")
#: the methods that explain a generation (`relevancy.generation.GENERATION_METHODS`), named here so that the help
#: loads no torch; a test keeps them equal to the registry's
GENERATION_METHOD_NAMES = ("attnlrp", "cp_lrp", "input_x_gradient", "raw_attention", "rollout", "attention_gradcam",
                           "generic_attention", "cdam", "transformer_attribution", "partial_lrp", "lrp", "token_ablation")
#: the most new tokens one command (or server request) explains: a bounded run (the library's bound is the model's
#: context window)
MAX_NEW_TOKENS = 256
DEFAULT_OUT = "relevancy-out"
#: the most input files one command explains (each is a PNG and part of one batch in memory)
MAX_FILES = 100
#: the most texts (explain-text) or questions (explain-question) one command explains
MAX_TEXTS = 100
#: the longest text explain-text reads, characters (longer texts are truncated to the model's tokens anyway)
MAX_TEXT_CHARS = 100_000


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2, nothing written."""


def warn(command: str, message: str) -> None:
    """A one-line warning on stderr (stdout may carry JSON)."""
    print(f"relevancy {command}: warning: {message}", file=sys.stderr)


def at_least(option: str, value: int | None, minimum: int, why: str = "") -> None:
    """A UsageError unless `value` (None: not given) is at least `minimum`."""
    if value is not None and value < minimum:
        raise UsageError(f"{option} must be at least {minimum}{why}, got {value}")


def check_inputs(kind: str, items: list[str], most: int, longest: int | None = None) -> None:
    """A UsageError unless there are at most `most` `kind` (e.g. "images"), each non-empty with at most `longest`
    characters where given."""
    if len(items) > most:
        raise UsageError(f"{len(items):,} {kind} given; the limit is {most:,} per run (split them over several runs)")
    for i, item in enumerate(items):
        if longest is not None and len(item) > longest:
            raise UsageError(f"{kind[:-1]} {i} has {len(item):,} characters; the limit is {longest:,}")


def at_most(option: str, value: int | float | None, minimum: int | float, maximum: int | float, why: str = "") -> None:
    """A UsageError naming the range unless `value` (None: not given) lies in [`minimum`, `maximum`]."""
    if value is not None and not minimum <= value <= maximum:
        raise UsageError(f"{option} must be between {minimum:,} and {maximum:,}{why}, got {value:,}")


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


def explanation_numbers(explanation: Explanation, index: int) -> dict[str, Any]:
    """What `--json` prints for one input and method: the target, its class name and logit, the scores."""
    target = int(explanation.target[index])
    names = explanation.class_names
    return {
        "target": target,
        "class": names[target] if names and 0 <= target < len(names) else None,
        "logit": float(explanation.logits[index, target]) if target >= 0 else None,
        "signed": explanation.signed,
        "scores": explanation.scores[index].detach().float().cpu().tolist(),
    }


# -- images ---------------------------------------------------------------------------------------------------
def read_image(path: str, command: str = "explain") -> Image.Image:
    """An image file as an 8-bit RGB picture (`relevancy.pictures.read_image`), its warnings as `command`'s."""
    from ..pictures import read_image as read

    return read(path, lambda message: warn(command, message))


def resolve_methods(method: str, offered: Sequence[str], family: str) -> list[str]:
    """`all` (every method `offered`, a family's `Adapter.methods`) or one of them; a UsageError naming them and
    the closest name otherwise (`family`: whose methods they are, for the message)."""
    from ..methods import REGISTRY, lookup

    if method == "all":
        return list(offered)
    if method in REGISTRY and method not in offered:
        raise UsageError(f"method {method} does not explain {family}; use one of {', '.join(offered)}")
    try:
        lookup(method, offered, f"methods of {family}")
    except ValueError as error:
        raise UsageError(str(error)) from error
    return [method]


# -- commands -------------------------------------------------------------------------------------------------
