"""Text classifiers: the shipped sentiment model, tokenising with truncation, coloured-text explanations.

`load_model()` and `encode()` import transformers on first use, so `import relevancy` stays light.
"""
from __future__ import annotations

from .explanation import TextExplanation


def load_model(name_or_dir: str | None = None, device: str | None = None):
    """`(model, tokenizer)`: the shipped sentiment model (default) or any BERT-family classifier by hub name or folder."""
    from .model import load_model as _load

    return _load(name_or_dir, device=device)


def encode(tokenizer, texts, max_length: int | None = None, model=None):
    """The tokenizer's padded batch for `texts`, truncated to the model's length with a warning."""
    from .model import encode as _encode

    return _encode(tokenizer, texts, max_length=max_length, model=model)


def concept(model, examples):
    """A CDAM `Concept` from example texts (the tokenizer's output): the mean pre-logits latent (pooler output)."""
    import torch

    from ..adapters import adapter_for
    from ..targets import Concept

    adapter = adapter_for(model)
    inputs = adapter.check_inputs(examples)
    with adapter.explaining(attention_probabilities=False), torch.no_grad():
        latents = adapter.forward(inputs)[1]
    return Concept.from_vector(latents.mean(0))


__all__ = ["TextExplanation", "concept", "encode", "load_model"]
