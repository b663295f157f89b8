"""Decoder language models: the Llama layout (Llama, Qwen2, Mistral, SmolLM2) and GPT-2."""
from .adapter import CausalLMAdapter
from .targets import Contrast, Span

__all__ = ["CausalLMAdapter", "Contrast", "Span"]
