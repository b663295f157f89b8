"""Decoder language models: the layouts of `layouts.py` (Llama, Qwen2/3, Mistral, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3,
OLMo 2, GPT-NeoX, GPT-2), each checked on the model's modules."""
from .adapter import CausalLMAdapter
from .targets import Contrast, Span

__all__ = ["CausalLMAdapter", "Contrast", "Span"]
