"""Vision-language decoders: LLaVA, LLaVA-NeXT / OneVision, Gemma 3 with images, Idefics3 / SmolVLM, Qwen2-VL and Qwen2.5-VL (`layouts.py`, `qwen.py`, `tiled.py`), explained from the
pixels and the prompt's tokens (`adapter.py`)."""
from .adapter import VisionLanguageAdapter
from .qwen import QwenVisionLanguageAdapter
from .tiled import TiledVisionLanguageAdapter
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation

__all__ = ["VisionLanguageAdapter", "QwenVisionLanguageAdapter", "TiledVisionLanguageAdapter", "VisionLanguageExplanation", "VisionLanguageGenerationExplanation"]
