"""The ICCV'21 perturbation test for question-answering models (LXMERT, VisualBERT), as the authors' code runs it.

One modality is perturbed per run, the other left intact. For each question the predicted answer is explained;
at each step a fraction of the question's tokens (or of the image's regions) is **removed** (deleted from the
input, not masked), least relevant first (negative perturbation) or most relevant first (positive), and the
model answers again; accuracy is the mean soft score of its answer (VQA: `labels[answer]`, 0 if absent). The
paper reports the area under accuracy against the removed fraction.

Per family, as in the authors' files (`lxmert/perturbation.py`, VisualBERT's `evaluation_loop.py`):

| | LXMERT | VisualBERT |
| --- | --- | --- |
| maps | min-max normalised text and image rows | the raw row |
| image steps | 0, .25, .5, .75, .8, .85, .9, .95, 1 | 0, .5, .75, .95, .96, .97, .98, .99, 1 |
| regions kept | top `int((1 - step) N)`, in rank order | the same |
| tokens ranked | all but [CLS] and [SEP] (kept) | all but [CLS], the pooled token and [SEP] (kept) |
| tokens kept | top `int((1 - step) (T - 2))`, original order | top `int((1 - step) (T - 3))`, original order |

Text steps are LXMERT's for both. One deviation: transformers' LXMERT cannot run on zero regions, so where a step
removes every region the image side is skipped for LXMERT (the authors' fork ran it); VisualBERT runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..api import explain
from ..families import LxmertAdapter, VisualBertAdapter, adapter_for
from ..families.regions import answer_logits

STEPS = (0.0, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
VISUALBERT_IMAGE_STEPS = (0.0, 0.5, 0.75, 0.95, 0.96, 0.97, 0.98, 0.99, 1.0)
MODALITIES = ("text", "image")
REGION_FIELDS = {"lxmert": ("visual_feats", "visual_pos", "visual_attention_mask"),
                 "visualbert": ("visual_embeds", "visual_attention_mask", "visual_token_type_ids")}
TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class Protocol:
    """The authors' per-family choices (see the module docstring)."""

    family: str
    min_max: bool
    image_steps: tuple[float, ...]
    zero_regions: bool  # the model runs on an input without regions


PROTOCOLS = {
    "lxmert": Protocol("lxmert", min_max=True, image_steps=STEPS, zero_regions=False),
    "visualbert": Protocol("visualbert", min_max=False, image_steps=VISUALBERT_IMAGE_STEPS, zero_regions=True),
}


def protocol_of(model: nn.Module) -> Protocol:
    adapter = adapter_for(model)
    if isinstance(adapter, LxmertAdapter):
        return PROTOCOLS["lxmert"]
    if isinstance(adapter, VisualBertAdapter):
        return PROTOCOLS["visualbert"]
    raise ValueError(f"the question-answering perturbation test runs on LXMERT and VisualBERT models, not {adapter.family}")


def kept_tokens(scores: torch.Tensor, length: int, protocol: Protocol, step: float) -> torch.Tensor:
    """The token positions kept at `step`, in their original order: the special ones always, then the best ranked."""
    fixed = [0, length - 1] if protocol.family == "lxmert" else [0, length - 2, length - 1]
    ranked = [p for p in range(length) if p not in fixed]
    count = int((1 - step) * len(ranked))
    best = torch.tensor(ranked)[scores[ranked].topk(count).indices] if count else torch.tensor([], dtype=torch.long)
    return torch.cat([torch.tensor(fixed), best]).sort().values


def kept_regions(scores: torch.Tensor, step: float) -> torch.Tensor:
    """The regions kept at `step`, best first (the authors pass them in rank order)."""
    return scores.topk(int((1 - step) * len(scores))).indices


def select(inputs: Mapping[str, torch.Tensor], fields: Iterable[str], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """`inputs` with the given fields cut to `index` along their sequence axis (dimension 1)."""
    return {k: (v[:, index] if k in fields and v is not None else v) for k, v in inputs.items()}


def accuracy(model: nn.Module, inputs: Mapping[str, torch.Tensor], labels: Mapping[int, float]) -> float:
    with torch.no_grad():
        answer = int(answer_logits(model(**inputs)).argmax(-1)[0])
    return float(labels.get(answer, 0.0))


def perturbation_test(
    model: nn.Module, samples: Iterable[tuple[Mapping[str, torch.Tensor], Mapping[int, float]]], method: str,
    modality: str = "image", positive: bool = True, **options: Any,
) -> dict[str, Any]:
    """Accuracy at each removal step and its area, over `samples`: (inputs of one question, the soft score of each
    answer index, e.g. VQA's `{answer: score}`)."""
    if modality not in MODALITIES:
        raise ValueError(f"modality must be one of {', '.join(MODALITIES)}, got {modality!r}")
    protocol = protocol_of(model)
    steps = protocol.image_steps if modality == "image" else STEPS
    totals, count = np.zeros(len(steps)), 0
    for inputs, labels in samples:
        if len(inputs["input_ids"]) != 1:
            raise ValueError("the perturbation test takes one question per sample (batch 1), as the authors' code does")
        expl = explain(model, dict(inputs), method=method, **options)
        scores = expl.parts[modality].scores[0].detach().double()
        if modality == "text":
            scores = scores[: int(inputs["attention_mask"][0].sum()) if "attention_mask" in inputs else len(scores)]
        if protocol.min_max:
            span = scores.max() - scores.min()
            scores = (scores - scores.min()) / span if span > 0 else torch.zeros_like(scores)
        if positive:
            scores = -scores
        for s, step in enumerate(steps):
            if modality == "text":
                kept = select(inputs, TEXT_FIELDS, kept_tokens(scores, len(scores), protocol, step))
            else:
                index = kept_regions(scores, step)
                if len(index) == 0 and not protocol.zero_regions:
                    continue
                kept = select(inputs, REGION_FIELDS[protocol.family], index)
            totals[s] += accuracy(model, kept, labels)
        count += 1
    curve = totals / max(count, 1)
    measured = [s for s, step in enumerate(steps) if modality == "text" or protocol.zero_regions or step < 1.0]
    return {"method": method, "modality": modality, "positive": positive, "n": count,
            "steps": [steps[s] for s in measured], "accuracy": [float(curve[s]) for s in measured],
            "auc": trapezoid_area([steps[s] for s in measured], curve[measured])}


def trapezoid_area(steps: Sequence[float], accuracy: Sequence[float]) -> float:
    """The area under an accuracy curve over the removed fraction (trapezoids)."""
    xs, ys = np.asarray(steps, dtype=np.float64), np.asarray(accuracy, dtype=np.float64)
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2))
