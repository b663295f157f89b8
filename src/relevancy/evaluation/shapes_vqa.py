"""`relevancy evaluate --benchmark shapes-vqa`: bi-modal explanations of a visual-question-answering LXMERT scored
against ground truth, on both sides.

The questions are the shapes visual-question world's (`relevancy.worlds.questions.make_questions`: scenes of one to three
objects, ten regions each, questions of five types), on scenes never seen in training (``make_questions(n, seed)``,
seed `VQA_TEST_SEED` + 3 ``--seed``). Every question knows the regions of the object(s) it is about
(``target_regions``: the named object; for relations the referent and the answer; for counts the counted objects;
none for an existence question answered "no") and the question words that name them (``target_tokens``: the shape
and colour words, ``object``/``objects``).

1. **Maps**: each question's *predicted* answer (as the ICCV'21 authors explain it) is explained by each method, a
   batch of questions per `explain` call: a score per region (the image part, ``(n, 10)``) and per token (the text
   part). Before its first timed call each method explains the first batch once untimed.
2. **Metrics**, per method over the questions with a target object (``has_target``), means over questions:

   * ``share``: the share of the positive image relevance on the target regions, ``sum(max(s, 0)[target]) /
     sum(max(s, 0))`` over the ten regions (`relevancy.evaluation.metrics.discrimination.class_discrimination` on the
     region row); 0 for a map with no positive value (counted in ``empty_maps``). ``other_share``: the same on the
     regions of the scene's other objects (those the question is not about); the rest lies on background regions.
   * ``pointing``: whether the highest-scoring region (the first on ties) is a target region.
   * ``token_f1``: the F1 of the question's ``k`` highest-scoring words against the words that name the target
     object(s), ``k`` = the number of those words (1 or 2), among the question's words (``<start>`` and ``<end>``
     left out): the shapes-clip benchmark's token-F1 (`relevancy.evaluation.grounding.token_f1`, whose captions
     always have k = 2 naming words). With k = the number of naming words precision = recall = F1 = hits / k.
   * ``per_type``: the same per question type; ``correct``: the same over the questions answered correctly.
   * ``chance``: what a uniform random ranking scores, over the same questions: target regions / regions (share,
     pointing), other objects' regions / regions (other_share), naming words / question words (token_f1).
     ``chance.objects``: a question-blind map that scores every object region 1 and the background 0 (a detector
     of objects that ignores the question; pointing with a random object): target regions / object regions
     (share, pointing), the rest of the objects' regions (other_share). The shapes' regions stand out from the
     background regions (saturated colour), so a map that only finds objects already beats the uniform chance;
     this row is the bar for reading the question.
3. **Perturbation** (the ICCV'21 test, `relevancy.evaluation.vqa_perturbation.perturbation_test`, LXMERT's
   protocol): on the first ``perturbation_n`` questions (all types, one at a time, unpadded), the question's tokens
   (text) or the regions (image) are removed most relevant first (positive: lower is better) or least relevant
   first (negative: higher is better) and the model answers again; accuracy against the true answer at each step,
   and the area under it. Text steps 0 .. 1, image steps 0 .. 0.95 (transformers' LXMERT cannot run without
   regions), so an image AUC is at most 0.95. All four runs (text and image, positive and negative) are made; each
   explains its question again (batch 1) and answers 8-9 perturbed copies, which makes this part 15 to 60 times
   the cost of the maps: hence the subset.

``accuracy``: the model's on all ``n`` questions (`relevancy.worlds.shapes_lxmert.evaluate_vqa`). Every fraction is in
[0, 1]; ``seconds_per_question`` is a method's `explain` time over all ``n`` questions,
``perturbation.seconds_per_question`` its four perturbation runs' time over the ``perturbation_n`` questions.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..api import explain
from ..worlds.questions import N_REGIONS, QUESTION_TYPES, VqaBatch, make_questions
from ..worlds.shapes_lxmert import VQA_TEST_SEED, evaluate_vqa
from .metrics.discrimination import class_discrimination
from .grounding import token_f1
from .shards import Shards
from .support import supported_methods
from .vqa_perturbation import STEPS, perturbation_test, trapezoid_area

__all__ = [
    "DEFAULT_PERTURBATION_N", "UNITS", "evaluate_shapes_vqa", "naming_f1", "perturbation_samples",
    "region_scores", "supported_methods", "vqa_report",
]

#: questions of the perturbation test when not given: its four runs cost 15 to 60 times the maps
DEFAULT_PERTURBATION_N = 100
UNITS = ("fractions in [0, 1] (report.md shows them in percent); perturbation AUCs: area under the accuracy "
         "(0..1) over the removed fraction (text 0..1, image 0..0.95); seconds_per_question: seconds")
_GROUNDING_KEYS = ("share", "other_share", "pointing", "token_f1")
_TEXT_FIELDS = ("input_ids", "attention_mask", "token_type_ids")



def object_regions(batch: VqaBatch) -> torch.Tensor:
    """``(n, N)`` bool: the regions holding one of the scene's objects."""
    regions = torch.zeros(len(batch), batch.target_regions.shape[1], dtype=torch.bool)
    for i, row in enumerate(batch.object_region.tolist()):
        for r in row:
            if r >= 0:
                regions[i, r] = True
    return regions


def region_scores(scores: torch.Tensor, target: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per question, from region scores ``(B, N)`` and the target / other objects' regions ``(B, N)`` bool:
    ``share``, ``other_share`` (float64), ``pointing`` (float64 0/1), ``empty`` (bool: no positive relevance)."""
    scores = scores.detach().double().cpu()
    d = class_discrimination(scores[:, None, :], target[:, None, :].cpu(), other[:, None, :].cpu())
    return {"share": d["target_share"], "other_share": d["other_share"], "pointing": d["pointing"].double(),
            "empty": ~(scores > 0).any(1)}


def naming_f1(text_scores: torch.Tensor, attention_mask: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """Per question ``(B,)`` float64: F1 of its k best-scoring words (positions 1 .. end - 1) against the naming
    positions ``target_tokens`` ``(B, T)``, k = their number; NaN for a question without naming words."""
    scores = text_scores.detach().double().cpu()
    ends = attention_mask.sum(1).cpu() - 1  # the <end> token's position
    naming = [set(row.nonzero().flatten().tolist()) for row in target_tokens.cpu()]
    out = torch.full((len(scores),), math.nan, dtype=torch.float64)
    for k in sorted({len(s) for s in naming} - {0}):
        rows = [i for i, s in enumerate(naming) if len(s) == k]
        out[rows] = token_f1(scores[rows], ends[rows], [naming[i] for i in rows], k=k)
    return out


def perturbation_samples(batch: VqaBatch, indices: Sequence[int]) -> list[tuple[dict[str, torch.Tensor], dict[int, float]]]:
    """The perturbation test's samples: each question alone, cut to its real tokens, with its true answer scoring 1."""
    inputs = batch.model_inputs()
    lengths = batch.attention_mask.sum(1).tolist()
    return [({k: v[i : i + 1, : lengths[i]] if k in _TEXT_FIELDS else v[i : i + 1] for k, v in inputs.items()},
             {int(batch.answers[i]): 1.0}) for i in indices]


def _perturbation(parts: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The four perturbation runs over all questions from those of each chunk (accuracies weighted by questions)."""
    runs: dict[str, Any] = {}
    for modality in ("text", "image"):
        runs[modality] = {}
        for sign in ("positive", "negative"):
            own = [part[f"{modality} {sign}"] for part in parts]
            count = sum(r["n"] for r in own)
            curve = [math.fsum(r["accuracy"][s] * r["n"] for r in own) / max(count, 1) for s in range(len(own[0]["steps"]))]
            runs[modality][sign] = {"auc": trapezoid_area(own[0]["steps"], curve), "accuracy": curve}
            runs[modality]["steps"] = own[0]["steps"]
    return runs


def _mean(values: torch.Tensor | np.ndarray | list) -> float:
    values = [float(v) for v in values if not math.isnan(float(v))]
    return math.fsum(values) / len(values) if values else math.nan


def _grounding(values: dict[str, torch.Tensor], select: np.ndarray) -> dict[str, Any]:
    picked = {k: v[torch.from_numpy(select)] for k, v in values.items()}
    return {"n": int(select.sum()), **{k: _mean(picked[k]) for k in _GROUNDING_KEYS}}


def evaluate_shapes_vqa(
    model: nn.Module, n: int = 300, methods: Sequence[str] | None = None, seed: int = VQA_TEST_SEED,
    batch_size: int = 50, perturbation_n: int | None = None, progress: bool = False, batch: VqaBatch | None = None,
    shards: Shards | None = None,
) -> dict[str, Any]:
    """The benchmark's numbers per method (see the module's docstring); JSON-able (NaN where no question counts).

    ``methods``: default every method the model's family offers (:func:`supported_methods`); ``perturbation_n``:
    questions of the perturbation test (default ``min(n, DEFAULT_PERTURBATION_N)``, 0: skip it); ``batch``: the
    questions (default ``make_questions(n, seed)``); ``shards``: where each batch's record goes as it finishes
    (`relevancy.evaluation.shards`; default in memory, one process)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be at least 1, got n={n}, batch_size={batch_size}")
    perturbation_n = min(n, DEFAULT_PERTURBATION_N) if perturbation_n is None else perturbation_n
    if not 0 <= perturbation_n <= n:
        raise ValueError(f"perturbation_n must be in 0..n ({n}), got {perturbation_n}")
    model.eval()
    batch = make_questions(n, seed) if batch is None else batch
    n = len(batch)
    if methods is None:
        methods = supported_methods(model)
    accuracy = evaluate_vqa(model, batch=batch, seed=seed)
    inputs = batch.model_inputs()
    has_target = np.asarray(batch.has_target, bool)
    other = object_regions(batch) & ~batch.target_regions
    types = np.asarray(batch.qtype)
    warm: set[str] = set()

    def chunk(start: int) -> dict[str, Any]:
        """The record of questions ``start .. start + batch_size - 1``: per method its maps, answers and timings,
        and the perturbation runs of those among the first ``perturbation_n``."""
        part = {k: v[start : start + batch_size] for k, v in inputs.items()}
        record: dict[str, Any] = {}
        for method in methods:
            if method not in warm:  # untimed: a method's first call in this process pays one-off costs
                explain(model, {k: v[:batch_size] for k, v in inputs.items()}, method=method)
                warm.add(method)
            started = time.perf_counter()
            expl = explain(model, part, method=method)  # the predicted answer
            record[method] = {"seconds": time.perf_counter() - started, "text": expl.parts["text"].scores.detach().cpu(),
                              "image": expl.parts["image"].scores.detach().cpu(), "answers": expl.target.cpu()}
            perturbed = range(start, min(start + batch_size, perturbation_n))
            if len(perturbed):
                started = time.perf_counter()
                samples = perturbation_samples(batch, perturbed)
                record[method]["perturbation"] = {f"{modality} {sign}": perturbation_test(model, samples, method, modality=modality,
                                                                                           positive=sign == "positive")
                                                  for modality in ("text", "image") for sign in ("positive", "negative")}
                record[method]["perturbation_seconds"] = time.perf_counter() - started
        return record

    starts = list(range(0, n, batch_size))
    chunks = (Shards() if shards is None else shards).map(starts, chunk, progress, "shapes-vqa", "question",
                                                        lambda start: len(range(start, min(n, start + batch_size))))
    results: dict[str, Any] = {}
    for method in methods:
        own = [c[method] for c in chunks]
        values = region_scores(torch.cat([c["image"] for c in own]), batch.target_regions, other)
        values["token_f1"] = naming_f1(torch.cat([c["text"] for c in own]), batch.attention_mask, batch.target_tokens)
        correct = (torch.cat([c["answers"] for c in own]) == batch.answers).numpy()
        record = {**_grounding(values, has_target), "empty_maps": int(values["empty"][torch.from_numpy(has_target)].sum()),
                  "seconds_per_question": math.fsum(c["seconds"] for c in own) / n}
        record.pop("n")
        record["per_type"] = {name: _grounding(values, has_target & (types == t)) for t, name in enumerate(QUESTION_TYPES)}
        record["correct"] = _grounding(values, has_target & correct)
        if perturbation_n:
            record["perturbation"] = _perturbation([c["perturbation"] for c in own if "perturbation" in c])
            record["perturbation"]["seconds_per_question"] = math.fsum(c.get("perturbation_seconds", 0.0) for c in own) / perturbation_n
        results[method] = record
    # chance: a uniform random ranking, over the same questions
    sel = torch.from_numpy(has_target)
    words = (batch.attention_mask.sum(1) - 2).double()
    chance_values = {
        "share": batch.target_regions.double().mean(1), "pointing": batch.target_regions.double().mean(1),
        "other_share": other.double().mean(1),
        "token_f1": torch.where(batch.target_tokens.any(1), batch.target_tokens.sum(1).double() / words, math.nan),
    }
    chance = {k: _mean(v[sel]) for k, v in chance_values.items()}
    # a question-blind map spread evenly over the scene's objects (every object region scores 1, the rest 0)
    objects = object_regions(batch).double().sum(1).clamp(min=1)
    blind = batch.target_regions.double().sum(1) / objects
    chance["objects"] = {"share": _mean(blind[sel]), "pointing": _mean(blind[sel]), "other_share": _mean((1 - blind)[sel])}
    chance["per_type"] = {name: {k: _mean(v[torch.from_numpy(has_target & (types == t))]) for k, v in chance_values.items()}
                          for t, name in enumerate(QUESTION_TYPES)}
    return {
        "benchmark": "shapes-vqa", "n": n, "seed": seed, "units": UNITS, "regions": N_REGIONS,
        "with_target": int(has_target.sum()),
        "with_target_per_type": {name: int((has_target & (types == t)).sum()) for t, name in enumerate(QUESTION_TYPES)},
        "accuracy": {k: accuracy[k] for k in ("overall", "per_type", "count_per_type")},
        "token_f1_rule": "top-k question words (without <start> and <end>), k = the number of naming words",
        "perturbation": {"n": perturbation_n, "questions": f"the first {perturbation_n} of the {n} questions, all types",
                         "text_steps": list(STEPS), "explained": "the predicted answer", "accuracy": "against the true answer"},
        "chance": chance,
        "methods": results,
    }


def _pct(value: Any, decimals: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{100 * value:.{decimals}f}"


def _auc(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.3f}"


def vqa_report(results: dict[str, Any]) -> str:
    """The results as Markdown tables (percentages; AUCs as fractions)."""
    chance, methods, acc = results["chance"], results["methods"], results["accuracy"]
    p = results["perturbation"]
    rows = []
    for m, v in methods.items():
        runs = v.get("perturbation")
        aucs = ([_auc(runs[mod][sign]["auc"]) for mod in ("text", "image") for sign in ("positive", "negative")]
                if runs else ["", "", "", ""])
        rows.append(f"| `{m}` | " + " | ".join(_pct(v[k]) for k in _GROUNDING_KEYS) + " | " + " | ".join(aucs)
                    + f" | {1000 * v['seconds_per_question']:.2f} |")
    rows.append("| uniform random (chance) | " + " | ".join(_pct(chance[k]) for k in _GROUNDING_KEYS) + " | | | | | |")
    blind = chance["objects"]
    rows.append("| question-blind: even over the objects' regions | " + " | ".join(_pct(blind[k]) for k in _GROUNDING_KEYS[:3])
                + " | | | | | | |")
    type_rows = []
    for name in QUESTION_TYPES:
        count = results["with_target_per_type"][name]
        cells = [f"{_pct(v['per_type'][name]['share'])} / {_pct(v['per_type'][name]['pointing'])} / "
                 f"{_pct(v['per_type'][name]['token_f1'])}" for v in methods.values()]
        c = chance["per_type"][name]
        type_rows.append(f"| {name} | {count} | {_pct(acc['per_type'][name])} | " + " | ".join(cells)
                         + f" | {_pct(c['share'])} / {_pct(c['pointing'])} / {_pct(c['token_f1'])} |")
    return "\n".join([
        f"# shapes-vqa ({results['n']} questions about unseen scenes of 1-3 objects, seed {results['seed']}), "
        f"model {results.get('model', '')}",
        "",
        f"Model accuracy {_pct(acc['overall'])} %. Every question's predicted answer is explained; the grounding "
        f"metrics are over the {results['with_target']} questions about an object (all but existence questions "
        "answered \"no\"), in %: share of the positive image relevance on the regions of the object(s) the question "
        "is about, and on the other objects' regions; pointing game (the top region is one of them); token-F1 of the "
        "question's top-k words against the words naming the object(s), k = their number (1 or 2).",
        "",
        f"Perturbation (ICCV'21, LXMERT protocol) on the first {p['n']} questions (all types): accuracy against the "
        "true answer as tokens / regions are removed, area under the curve; positive (most relevant first, lower is "
        "better), negative (least relevant first, higher is better). Text steps 0-1, image steps 0-0.95.",
        "",
        "| method | share ↑ | other share ↓ | pointing ↑ | token-F1 ↑ | text pos. AUC ↓ | text neg. AUC ↑ "
        "| image pos. AUC ↓ | image neg. AUC ↑ | ms / question |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Per question type (questions about an object): share / pointing / token-F1, in %.",
        "",
        "| type | questions | accuracy | " + " | ".join(f"`{m}`" for m in methods) + " | chance |",
        "| --- | --- | --- |" + " --- |" * len(methods) + " --- |",
        *type_rows,
        "",
    ])
