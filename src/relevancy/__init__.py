"""relevancy: what a transformer looked at. Relevance maps for timm and Hugging Face transformers.

The public names are imported on first use (module `__getattr__`), so that `import relevancy.apps.cli` and
`relevancy --help` load no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import explain
    from .results.explanation import DecoderExplanation, DetectionExplanation, Explanation, GenerationExplanation, ImageExplanation, PairExplanation, RegionTextExplanation, TextExplanation, load
    from .families.clip.batch import ImageTextBatch
    from .families.clip.zero_shot import ZeroShotClassifier
    from .families.detr import detect
    from .families.causal_lm import Contrast, Span
    from .generation import explain_generation
    from .corpus import explain_corpus, load_corpus
    from .methods.targets import Concept

    METHODS: tuple[str, ...]

__all__ = ["explain", "Explanation", "ImageExplanation", "PairExplanation", "RegionTextExplanation", "Concept", "Contrast", "Span", "ImageTextBatch", "ZeroShotClassifier", "detect", "DetectionExplanation", "DecoderExplanation", "GenerationExplanation", "TextExplanation", "explain_generation", "explain_corpus", "load_corpus", "load", "METHODS"]
from .core import __version__  # noqa: E402 (the one place it is written is core, below every layer)


def __getattr__(name: str) -> Any:
    """The public names (`METHODS`: the registered method names), imported when first read."""
    if name == "explain":
        from .api import explain as value
    elif name == "Explanation":
        from .results.explanation import Explanation as value
    elif name == "explain_generation":
        from .generation import explain_generation as value
    elif name in ("explain_corpus", "load_corpus"):
        from . import corpus

        value = getattr(corpus, name)
    elif name in ("ImageExplanation", "TextExplanation", "PairExplanation", "RegionTextExplanation", "DetectionExplanation",
                  "DecoderExplanation", "GenerationExplanation", "load"):
        from .results import explanation

        value = getattr(explanation, name)
    elif name == "ImageTextBatch":
        from .families.clip.batch import ImageTextBatch as value
    elif name == "ZeroShotClassifier":
        from .families.clip.zero_shot import ZeroShotClassifier as value
    elif name == "detect":
        from .families.detr import detect as value
    elif name == "Concept":
        from .methods.targets import Concept as value
    elif name in ("Contrast", "Span"):
        from .families import causal_lm

        value = getattr(causal_lm, name)
    elif name == "METHODS":
        from .methods import REGISTRY

        value = tuple(REGISTRY)
    else:
        raise AttributeError(f"module 'relevancy' has no attribute '{name}'")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
