"""A small LXMERT answering questions about the shapes world (``transformers.LxmertForQuestionAnswering``).

>>> from relevancy.worlds.questions import make_questions
>>> from relevancy.worlds.shapes_lxmert import load_vqa_lxmert
>>> model, tokenizer = load_vqa_lxmert()       # shipped weights, eval mode, offline
>>> batch = make_questions(8, seed=10**9 + 30_000)
>>> scores = model(**batch.model_inputs()).question_answering_score   # (8, len(ANSWERS))

The inputs are those of :mod:`relevancy.worlds.questions`: word-level question tokens (``<start>`` first, as
LXMERT's [CLS]) and :data:`~relevancy.worlds.questions.N_REGIONS` regions with
:data:`~relevancy.worlds.questions.FEATURE_DIM` features and normalised boxes.  Evaluation
(:func:`evaluate_vqa`) uses ``make_questions`` seed :data:`VQA_TEST_SEED` (scene seeds
``EVAL_SEED_BASE + 30_000 .. + 30_002``); training seeds are all below ``EVAL_SEED_BASE``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .captions import Tokenizer
from .shapes_vit import EVAL_SEED_BASE, WEIGHTS_DIR
from .questions import (ANSWERS, FEATURE_DIM, MAX_LENGTH, QUESTION_TYPES, make_questions,
                  question_tokenizer)

__all__ = [
    "VQA_CONFIG",
    "VQA_WEIGHTS_PATH",
    "VQA_TEST_SEED",
    "VQA_VAL_SEED",
    "build_vqa_lxmert",
    "load_vqa_lxmert",
    "evaluate_vqa",
]

VQA_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_vqa_lxmert.safetensors"
#: make_questions seed of the test questions (scene seeds this, +1, +2)
VQA_TEST_SEED = EVAL_SEED_BASE + 30_000
#: make_questions seed of the validation questions logged during training
VQA_VAL_SEED = EVAL_SEED_BASE + 40_000

#: keyword arguments of :class:`transformers.LxmertConfig`
VQA_CONFIG = dict(
    vocab_size=len(question_tokenizer()),
    hidden_size=128,
    num_attention_heads=4,
    intermediate_size=256,
    l_layers=2,
    x_layers=2,
    r_layers=2,
    visual_feat_dim=FEATURE_DIM,
    visual_pos_dim=4,
    num_qa_labels=len(ANSWERS),
    max_position_embeddings=MAX_LENGTH,
    type_vocab_size=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    task_matched=False,
    task_mask_lm=False,
    task_obj_predict=False,
    visual_obj_loss=False,
    visual_attr_loss=False,
    visual_feat_loss=False,
    pad_token_id=0,
)


def build_vqa_lxmert(config: dict | None = None):
    """Untrained ``transformers.LxmertForQuestionAnswering`` with :data:`VQA_CONFIG` (or ``config``)."""
    from transformers import LxmertConfig, LxmertForQuestionAnswering

    cfg = dict(VQA_CONFIG)
    cfg.update(config or {})
    model = LxmertForQuestionAnswering(LxmertConfig(**cfg))
    model.config.id2label = dict(enumerate(ANSWERS))
    model.config.label2id = {a: i for i, a in enumerate(ANSWERS)}
    return model


def load_vqa_lxmert(path: str | Path | None = None, device: str | torch.device = "cpu"):
    """The shipped shapes LXMERT in eval mode and its tokenizer, ``(model, tokenizer)``.

    Reads ``shapes_vqa_lxmert.safetensors`` and, beside it, ``shapes_vqa_lxmert.json`` (config,
    vocabulary, answers); no network access.
    """
    from safetensors.torch import load_file

    path = Path(path) if path is not None else VQA_WEIGHTS_PATH
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no weights/config at {path} / {meta_path}; "
                                "run `python -m training.shapes_lxmert`")
    meta = json.loads(meta_path.read_text())
    tokenizer = Tokenizer(tuple(meta["vocab"][1:-2]))
    if tuple(meta["vocab"]) != tokenizer.vocab or tuple(meta["answers"]) != ANSWERS:
        raise ValueError(f"{meta_path}: vocabulary or answers differ from relevancy.worlds.questions")
    model = build_vqa_lxmert(meta["config"])
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return model.to(device), tokenizer


@torch.no_grad()
def predict(model, batch, batch_size: int = 500) -> torch.Tensor:
    """Answer indices (n,) of a :class:`~relevancy.worlds.questions.VqaBatch`."""
    device = next(model.parameters()).device
    inputs = batch.model_inputs()
    out = []
    for s in range(0, len(batch), batch_size):
        part = {k: v[s:s + batch_size].to(device) for k, v in inputs.items()}
        out.append(model(**part).question_answering_score.argmax(-1).cpu())
    return torch.cat(out)


@torch.no_grad()
def evaluate_vqa(model, n: int = 2000, seed: int = VQA_TEST_SEED, batch=None) -> dict:
    """Accuracy on ``n`` unseen scenes (one question each, ``make_questions(n, seed)``):
    ``{"overall": ..., "per_type": {type: accuracy}, "count_per_type": {...}, "n": n, "seed": seed}``."""
    was_training = model.training
    model.eval()
    try:
        batch = batch if batch is not None else make_questions(n, seed)
        pred = predict(model, batch)
    finally:
        model.train(was_training)
    right = (pred == batch.answers).numpy()
    per_type, counts = {}, {}
    for t, name in enumerate(QUESTION_TYPES):
        sel = batch.qtype == t
        counts[name] = int(sel.sum())
        per_type[name] = float(right[sel].mean()) if sel.any() else float("nan")
    return {"overall": float(np.mean(right)), "per_type": per_type, "count_per_type": counts,
            "n": len(batch), "seed": seed}
