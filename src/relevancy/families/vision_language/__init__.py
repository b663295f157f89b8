"""Vision-language decoders: LLaVA, Gemma 3 with images, Idefics3 / SmolVLM (`layouts.py`), explained from the
pixels and the prompt's tokens (`adapter.py`)."""
from .adapter import VisionLanguageAdapter
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation

__all__ = ["VisionLanguageAdapter", "VisionLanguageExplanation", "VisionLanguageGenerationExplanation"]
