"""Which registered methods explain a given model: the benchmarks run every method its family supports."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

__all__ = ["supported_methods"]


def supported_methods(
    model: nn.Module, inputs: Any, methods: Sequence[str] | None = None, target: Any = None,
    explain: Callable[..., Any] | None = None,
) -> tuple[str, ...]:
    """Those of ``methods`` (default: every registered method, in order) that explain ``model``: each explains
    ``inputs`` (a small probe input of the model) for ``target`` once; a method the model's family does not
    support (`UnsupportedModelError`, e.g. `lrp` on a two-stream model) is left out, any other error is raised.
    ``explain``: the function called (default `relevancy.explain`; a benchmark passes its own module's name for it)."""
    from .. import METHODS
    from ..families.base import UnsupportedModelError

    if explain is None:
        from ..api import explain

    kept = []
    for method in METHODS if methods is None else methods:
        try:
            explain(model, inputs, method=method, target=target)
        except UnsupportedModelError:
            continue
        kept.append(method)
    return tuple(kept)
