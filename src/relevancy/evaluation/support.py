"""Which registered methods explain a given model: the benchmarks run every method its family offers."""
from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["supported_methods"]


def supported_methods(model: nn.Module, methods: Sequence[str] | None = None) -> tuple[str, ...]:
    """Those of ``methods`` (default: every registered method, in the registry's order) that ``model``'s family
    offers (its adapter's `methods`)."""
    from ..families import adapter_for
    from ..methods import REGISTRY

    offered = adapter_for(model).methods
    return tuple(m for m in (REGISTRY if methods is None else methods) if m in offered)
