"""`explain()`: the one call. Picks the adapter, runs a method with the model prepared, builds the Explanation."""
from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from .adapters import adapter_for
from .adapters.base import UnsupportedModelError
from .explanation import Explanation
from .methods import REGISTRY
from .targets import Concept, Target


def get_method(name: str):
    """The registered method called `name`; an error suggesting the closest name otherwise."""
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, list(REGISTRY), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"unknown method '{name}'.{hint} Valid methods: {', '.join(REGISTRY)}")


def explain(model: nn.Module, inputs: Any, method: str = "transformer_attribution", target: Target = None, **options: Any) -> Explanation:
    """Explain `model`'s prediction on a batch: relevance of every patch (or pixel, for `lrp`) for `target`.

    `target`: None (the predicted class), an int or one int per image, or a `Concept`.
    `options` go to the method (e.g. `start_layer`, `chunk_size`). The model is handed back exactly as it was.
    """
    spec = get_method(method)
    adapter = adapter_for(model)
    if spec.reads_class_token and not adapter.has_class_token:
        raise UnsupportedModelError(
            f"method '{method}' reads the [CLS] row of attention, but this model has no class token "
            f"(global pooling). Use one of: {', '.join(n for n, m in REGISTRY.items() if not m.reads_class_token)}"
        )
    if isinstance(target, Concept) and not spec.accepts_concept:
        valid = ", ".join(n for n, m in REGISTRY.items() if m.accepts_concept)
        raise ValueError(f"method '{method}' explains classes, not a Concept; concept methods: {valid}")
    inputs = adapter.check_inputs(inputs)
    with adapter.explaining(attention_probabilities=spec.needs_attention):
        scores, indices, logits = spec.run(adapter, inputs, target, **options)
    if not spec.pixels:
        scores = adapter.arrange_token_scores(scores, inputs)
    return adapter.explanation_class(
        scores=scores.detach(),
        target=indices,
        logits=logits.detach(),
        method=method,
        signed=spec.signed,
        class_names=adapter.class_names(),
        concept=target if isinstance(target, Concept) else None,
        **adapter.describe_inputs(inputs),
    )
