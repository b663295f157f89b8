"""Vision-language decoders: LLaVA, LLaVA-NeXT / OneVision, Gemma 3 with images, Idefics3 / SmolVLM, PaliGemma, InternVL, Qwen2-VL and Qwen2.5-VL, Mistral 3 (`layouts.py`, `qwen.py`, `tiled.py`, `mistral3.py`, `internvl.py`), explained from the
pixels and the prompt's tokens (`adapter.py`)."""
from .adapter import VisionLanguageAdapter
from .internvl import InternVLAdapter
from .mistral3 import Mistral3VisionLanguageAdapter
from .qwen import QwenVisionLanguageAdapter
from .tiled import TiledVisionLanguageAdapter
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation

__all__ = ["VisionLanguageAdapter", "InternVLAdapter", "QwenVisionLanguageAdapter", "Mistral3VisionLanguageAdapter", "TiledVisionLanguageAdapter", "VisionLanguageExplanation", "VisionLanguageGenerationExplanation"]
