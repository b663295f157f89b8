"""Text classifiers: the shipped sentiment model, tokenising with truncation, coloured-text explanations.

`load_model()` and `encode()` import transformers on first use, so `import relevancy` stays light.
"""
from __future__ import annotations

from ...results.explanation import TextExplanation


def load_model(name_or_dir: str | None = None, device: str | None = None):
    """`(model, tokenizer)`: the shipped sentiment model (default) or any BERT-family classifier by hub name or folder."""
    from .model import load_model as _load

    return _load(name_or_dir, device=device)


def encode(tokenizer, texts, max_length: int | None = None, model=None):
    """The tokenizer's padded batch for `texts`, truncated to the model's length with a warning."""
    from .model import encode as _encode

    return _encode(tokenizer, texts, max_length=max_length, model=model)


__all__ = ["TextExplanation", "encode", "load_model"]
