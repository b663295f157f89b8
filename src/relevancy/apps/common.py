"""Usage errors, warnings, range checks, limits and method names: what the command line and the web page share
(no torch imported)."""
from __future__ import annotations

import sys
from typing import Sequence

#: the methods of the image models `relevancy explain` and the page take (`TimmViTAdapter.methods`,
#: `HFViTAdapter.methods`), named here so that the help loads no torch; a test keeps them equal to the registry's
METHOD_NAMES = ("raw_attention", "rollout", "attention_gradcam", "generic_attention", "transformer_attribution",
                "partial_lrp", "lrp", "cdam", "token_ablation")
#: the methods that explain a generation (`relevancy.generation.GENERATION_METHODS`), named here so that the help
#: loads no torch; a test keeps them equal to the registry's
GENERATION_METHOD_NAMES = ("attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map", "raw_attention", "rollout",
                           "attention_gradcam", "generic_attention", "cdam", "transformer_attribution", "partial_lrp", "lrp",
                           "token_ablation")
#: the most new tokens one command or server request explains: a bounded run (the library's bound is the model's
#: context window)
MAX_NEW_TOKENS = 256
#: the longest text one command or request explains, characters (longer texts are truncated to the model's tokens)
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


def at_most(option: str, value: int | float | None, minimum: int | float, maximum: int | float, why: str = "") -> None:
    """A UsageError naming the range unless `value` (None: not given) lies in [`minimum`, `maximum`]."""
    if value is not None and not minimum <= value <= maximum:
        raise UsageError(f"{option} must be between {minimum:,} and {maximum:,}{why}, got {value:,}")


def check_inputs(kind: str, items: list[str], most: int, longest: int | None = None) -> None:
    """A UsageError unless there are at most `most` `kind` (e.g. "images"), each with at most `longest` characters
    where given."""
    if len(items) > most:
        raise UsageError(f"{len(items):,} {kind} given; the limit is {most:,} per run (split them over several runs)")
    for i, item in enumerate(items):
        if longest is not None and len(item) > longest:
            raise UsageError(f"{kind[:-1]} {i} has {len(item):,} characters; the limit is {longest:,}")


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
