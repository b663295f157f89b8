"""`relevancy evaluate --benchmark llm-retrieval`: decoder language models' explanations scored against the known
evidence of the generated retrieval world (`relevancy.worlds.language`), and by deleting what they rank first.

1. **Prompts**: the first ``n`` test prompts of ``--seed`` (two people, six facts, a question asked first, the
   answer sentence started). Every prompt explains the logit of its *true* answer's first token
   (the token after the prompt when prompt and answer are tokenized together); ``accuracy`` is how often that
   token is also the model's greedy next token. Every metric is given over all prompts and over those answered
   right (``answered``): a map of a prompt the model got wrong explains a probability the model did not act on.
2. **Maps**: each method explains a batch of prompts per `explain` call; ``time_ratio`` is its time over a plain
   no-grad forward of the same batches (the forward computes the logits at every position), each method and the
   forward having run once untimed on the first prompt.
3. **Metrics**, per prompt, then means over prompts. The *context* is the facts' tokens (the question, the
   ``Answer:`` line and special tokens never count); the *evidence* is the supporting fact's tokens.

   * ``share``: positive relevance on the evidence over positive relevance on the context (0 for a map with no
     positive value on the context). The evidence is about a sixth of the context.
   * ``pointing``: whether the context token of highest relevance (the first on ties) is evidence.
   * ``morf`` and ``lerf``: the deletion test. The context tokens are ranked by relevance, most relevant first
     (MoRF) or least relevant first (LeRF, ties in position order); at each step of `STEPS` the first
     ``int(step * C)`` of the ``C`` context tokens are **removed from the sequence** (the rest, question and answer
     prefix included, keep their order) and the model reads the shortened prompt again. The curve is the answer
     token's log-probability minus the unperturbed one (0 at step 0); the value is the trapezoid area under it
     over the removed fraction 0..1 (like the image and question-answering perturbation tests, which plot against
     the removed fraction). MoRF: lower is better (the model loses the answer fast); LeRF: higher is better.
     Removal rather than replacement: a replacement token (padding, ``<unk>``, a space) is itself text the model
     reads and reacts to, while removal leaves a shorter, still well-formed list of facts; it is also how the
     house's question-answering test deletes tokens (`relevancy.evaluation.vqa_perturbation`).
     ``gap``: ``lerf - morf`` (higher is better), one number for both directions.
   * ``random``: the same metrics for scores drawn uniformly at random (each batch's generator seeded from ``--seed`` and
     its first prompt, so the draws do not depend on how the batches are shared out), the
     row that tells what a map blind to the evidence scores. ``chance``: what a uniformly random ranking scores
     in expectation on share and pointing, the evidence's fraction of the context tokens (mean over prompts).

All perturbed prompts (every prompt, direction and step; step 0 and the full deletion shared by both directions)
are read in forwards of ``deletion_batch_size`` sequences, right-padded, the answer read at each one's last real token.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..worlds import language as llm_world
from .deletion import DIRECTIONS, STEPS, area, curves_of, plan_deletions, ranked
from .shards import Shards

__all__ = [
    "DEFAULT_METHODS", "RANDOM", "STEPS", "UNITS", "Explainer", "answer_ids", "deletion_curves", "encode",
    "evaluate_llm_retrieval", "evidence_scores", "llm_report",
]

#: relevancy's methods that explain decoder language models, in the order the report lists them
DEFAULT_METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "transformer_attribution", "generic_attention",
                   "attention_gradcam", "rollout", "raw_attention", "partial_lrp", "lrp", "token_ablation")
RANDOM = "random"
#: the random row's generator of the batch starting at prompt ``i`` is seeded ``seed * MAX_PROMPTS + i``
MAX_PROMPTS = 1_000_000
UNITS = ("share, pointing, accuracy: fractions in [0, 1]; morf, lerf, gap: area under the answer token's "
         "log-probability (nats, minus the unperturbed one) over the removed fraction of the facts' tokens (0..1); "
         "clean_log_probability: nats; time_ratio: a method's time over a plain forward of the same batch")
_METRICS = ("share", "pointing", "morf", "lerf", "gap")

#: an explainer outside relevancy (lxt, captum, inseq in benchmarks/llm_retrieval.py): (model, inputs, target ids)
#: -> (B, T) scores over the input tokens
Explainer = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


def encode(tokenizer: Any, items: Sequence[llm_world.RetrievalPrompt]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(inputs, context, evidence)``: the prompts tokenized one by one and right-padded here (so neither the
    tokenizer's padding side nor a pad token matters; ``input_ids``, ``attention_mask``), and the ``(B, T)`` bool
    masks of the facts' tokens and of the supporting fact's tokens."""
    rows = [tokenizer(item.text, return_offsets_mapping=True) for item in items]
    width = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(items), width, dtype=torch.long)
    context = torch.zeros(len(items), width, dtype=torch.bool)
    evidence = torch.zeros(len(items), width, dtype=torch.bool)
    for i, (item, row) in enumerate(zip(items, rows)):
        length, offsets = len(row["input_ids"]), row["offset_mapping"]
        start = item.text.index("\n") + 1
        ids[i, :length] = torch.tensor(row["input_ids"])
        context[i, :length] = torch.tensor(item.token_mask(offsets, (start, start + len(" ".join(item.facts)))))
        evidence[i, :length] = torch.tensor(item.token_mask(offsets)) & context[i, :length]
    lengths = torch.tensor([len(row["input_ids"]) for row in rows])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}, context, evidence


def answer_ids(tokenizer: Any, items: Sequence[llm_world.RetrievalPrompt], inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``(B,)``: each true answer's first token, as the tokenizer splits prompt and answer written together."""
    lengths = inputs["attention_mask"].sum(1).tolist()
    ids = []
    for item, length, row in zip(items, lengths, inputs["input_ids"].tolist()):
        whole = tokenizer(item.text + item.answer)["input_ids"]
        if whole[:length] != row[:length] or len(whole) <= length:
            raise ValueError(f"the tokenizer joins the answer {item.answer!r} to the prompt's last token; "
                             "llm-retrieval needs a tokenizer that starts a token at the answer's space")
        ids.append(whole[length])
    return torch.tensor(ids)


def evidence_scores(scores: torch.Tensor, context: torch.Tensor, evidence: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per prompt, from ``(B, T)`` scores and masks: ``share`` (float64: positive relevance on the evidence over
    positive relevance on the context) and ``pointing`` (float64 0/1: the best context token is evidence)."""
    scores = scores.detach().double().cpu()
    positive = scores.clamp(min=0)
    total = (positive * context).sum(1)
    share = torch.where(total > 0, (positive * evidence).sum(1) / total.clamp(min=1e-300), torch.zeros_like(total))
    best = torch.where(context, scores, torch.tensor(-math.inf, dtype=scores.dtype)).argmax(1)
    return {"share": share, "pointing": evidence.gather(1, best[:, None])[:, 0].double()}


@torch.no_grad()
def _answer_log_probabilities(model: nn.Module, sequences: Sequence[torch.Tensor], answers: Sequence[int],
                              batch_size: int) -> torch.Tensor:
    """The log-probability of ``answers[i]`` after ``sequences[i]`` (1-D token ids), read right-padded in forwards
    of ``batch_size`` sequences (padding id 0, masked)."""
    out = torch.empty(len(sequences), dtype=torch.float64)
    for start in range(0, len(sequences), batch_size):
        part = sequences[start:start + batch_size]
        lengths = torch.tensor([len(s) for s in part])
        ids = torch.zeros(len(part), int(lengths.max()), dtype=torch.long)
        for row, sequence in enumerate(part):
            ids[row, :len(sequence)] = sequence
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[torch.arange(len(part)), lengths - 1]
        targets = torch.tensor(answers[start:start + batch_size])
        out[start:start + len(part)] = logits.double().log_softmax(-1)[torch.arange(len(part)), targets]
    return out


def deletion_curves(model: nn.Module, inputs: Mapping[str, torch.Tensor], context: torch.Tensor, answers: torch.Tensor,
                    maps: Mapping[str, torch.Tensor], batch_size: int,
                    steps: Sequence[float] = STEPS) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """``(clean, curves)``: the answer's unperturbed log-probability ``(B,)`` and, per map name and direction
    (``morf``, ``lerf``), the ``(B, len(steps))`` change of that log-probability as the context tokens are removed
    in the map's order. Identical deletions (nothing removed, everything removed) are read once."""
    lengths = inputs["attention_mask"].sum(1).tolist()

    def order(name: str) -> Callable[[int, str], torch.Tensor]:
        def of(row: int, direction: str) -> torch.Tensor:
            positions = context[row, :lengths[row]].nonzero()[:, 0]
            return positions[ranked(maps[name][row, positions], direction)]
        return of

    deletions, plan = plan_deletions({name: order(name) for name in maps}, len(lengths), steps)
    sequences = []
    for row, removed in deletions:
        keep = torch.ones(lengths[row], dtype=torch.bool)
        keep[list(removed)] = False
        sequences.append(inputs["input_ids"][row, :lengths[row]][keep])
    values = _answer_log_probabilities(model, sequences, [int(answers[row]) for row, _ in deletions], batch_size)
    return curves_of(values, deletions, plan, len(lengths))


def _mean(values: Sequence[float]) -> float:
    values = [float(v) for v in values]
    return math.fsum(values) / len(values) if values else math.nan


def _summary(per_prompt: Mapping[str, list[float]], select: Sequence[bool]) -> dict[str, float]:
    return {k: _mean([v for v, keep in zip(per_prompt[k], select) if keep]) for k in _METRICS}


def evaluate_llm_retrieval(
    model: nn.Module, tokenizer: Any, methods: Sequence[str] = DEFAULT_METHODS, n: int = 30, seed: int = 0,
    batch_size: int = 8, explainers: Mapping[str, Explainer] | None = None, progress: bool = False,
    deletion_batch_size: int | None = None, shards: Shards | None = None,
) -> dict[str, Any]:
    """The benchmark's numbers per method (see the module's docstring), JSON-able (NaN where no prompt counts).

    ``methods``: relevancy method names; ``explainers``: more named maps computed outside relevancy, scored the
    same way (the side-by-side benchmark's lxt, captum and inseq); a ``random`` row is always added.
    ``batch_size``: prompts explained together; ``deletion_batch_size``: perturbed prompts read together (default
    ``batch_size``); ``shards``: where each batch's record goes as it finishes (`relevancy.evaluation.shards`;
    default in memory, one process). The model runs in eval mode; every module's mode is restored after."""
    deletion_batch_size = batch_size if deletion_batch_size is None else deletion_batch_size
    if min(n, batch_size, deletion_batch_size) < 1:
        raise ValueError(f"n and the batch sizes must be at least 1, got n={n}, batch_size={batch_size}, "
                         f"deletion_batch_size={deletion_batch_size}")
    modes = [(module, module.training) for module in model.modules()]  # each module's own, restored after
    model.eval()
    try:
        return _evaluate(model, tokenizer, tuple(methods), n, seed, batch_size, dict(explainers or {}), progress,
                         deletion_batch_size, Shards() if shards is None else shards)
    finally:
        for module, training in modes:
            module.training = training


def _evaluate(model: nn.Module, tokenizer: Any, methods: tuple[str, ...], n: int, seed: int, batch_size: int,
              explainers: dict[str, Explainer], progress: bool, deletion_batch_size: int, shards: Shards) -> dict[str, Any]:
    """`evaluate_llm_retrieval` on a model in eval mode: each batch of prompts is a chunk of `shards`."""
    from ..api import explain

    items = llm_world.prompts("test", n, seed=seed)
    names = [*methods, *explainers, RANDOM]
    warmed = []

    def explain_with(name: str, inputs: dict[str, torch.Tensor], answers: torch.Tensor) -> torch.Tensor:
        if name in methods:
            return explain(model, dict(inputs), method=name, target=answers.tolist()).scores.detach()
        return explainers[name](model, dict(inputs), answers).detach()

    def batch(start: int) -> dict[str, Any]:
        """One batch's record: per prompt values, the batch's timings."""
        if not warmed:  # untimed: each method's and the forward's first call in this process pays one-off costs
            warm = encode(tokenizer, items[:1])[0]
            with torch.no_grad():
                model(**warm, use_cache=False)
            for name in names[:-1]:
                explain_with(name, warm, answer_ids(tokenizer, items[:1], warm))
            warmed.append(True)
        part = items[start:start + batch_size]
        inputs, context, evidence = encode(tokenizer, part)
        answers = answer_ids(tokenizer, part, inputs)
        record: dict[str, Any] = {"evidence_fraction": (evidence.sum(1) / context.sum(1)).tolist(), "seconds": {},
                                  "per_prompt": {}, "curves": {}}
        began = time.perf_counter()
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
        record["forward_seconds"] = time.perf_counter() - began
        last = inputs["attention_mask"].sum(1) - 1
        record["right"] = (logits[torch.arange(len(part)), last].argmax(-1) == answers).tolist()
        generator = torch.Generator().manual_seed(seed * MAX_PROMPTS + start)  # the same draws however the batches are shared
        maps: dict[str, torch.Tensor] = {}
        for name in names:
            began = time.perf_counter()
            if name == RANDOM:
                maps[name] = torch.rand(context.shape, generator=generator, dtype=torch.float64)
                continue
            maps[name] = explain_with(name, inputs, answers)
            record["seconds"][name] = time.perf_counter() - began
        clean, curves = deletion_curves(model, inputs, context, answers, maps, deletion_batch_size)
        record["clean"] = clean.tolist()
        for name, scores in maps.items():
            values = {key: v.tolist() for key, v in evidence_scores(scores * inputs["attention_mask"], context, evidence).items()}
            morf, lerf = (area(curves[name][d]) for d in DIRECTIONS)
            record["per_prompt"][name] = {**values, "morf": morf.tolist(), "lerf": lerf.tolist(), "gap": (lerf - morf).tolist()}
            record["curves"][name] = {d: curves[name][d].tolist() for d in DIRECTIONS}
        return record

    starts = list(range(0, n, batch_size))
    records = shards.map(starts, batch, progress, "llm-retrieval", "prompt", lambda start: len(items[start:start + batch_size]))
    right = [v for r in records for v in r["right"]]
    clean_all = [v for r in records for v in r["clean"]]
    forward_seconds = math.fsum(r["forward_seconds"] for r in records)
    everything = [True] * n
    results: dict[str, Any] = {
        "benchmark": "llm-retrieval", "n": n, "seed": seed, "units": UNITS, "steps": list(STEPS),
        "accuracy": _mean(right), "answered": int(sum(right)), "clean_log_probability": _mean(clean_all),
        "chance": _mean([v for r in records for v in r["evidence_fraction"]]), "methods": {},
    }
    for name in names:
        per_prompt = {k: [v for r in records for v in r["per_prompt"][name][k]] for k in _METRICS}
        entry: dict[str, Any] = {**_summary(per_prompt, everything), "answered": _summary(per_prompt, right)}
        entry["curves"] = {d: np.mean([row for r in records for row in r["curves"][name][d]], axis=0).tolist() for d in DIRECTIONS}
        if name != RANDOM:
            seconds = math.fsum(r["seconds"][name] for r in records)
            entry["time_ratio"] = seconds / forward_seconds
            entry["seconds_per_prompt"] = seconds / n
        results["methods"][name] = entry
    return results


def _cell(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _rows(methods: Mapping[str, Any], answered: bool) -> list[str]:
    rows = []
    for name, entry in methods.items():
        values = entry["answered"] if answered else entry
        label = "random scores" if name == RANDOM else (f"`{name}`" if " " not in name else name)
        ratio = _cell(entry["time_ratio"], 2) if "time_ratio" in entry else ""
        rows.append(f"| {label} | " + " | ".join(_cell(values[k]) for k in _METRICS) + f" | {ratio} |")
    return rows


def llm_report(results: Mapping[str, Any]) -> str:
    """The results as Markdown: the prompts answered right, then all prompts."""
    header = ["| method | evidence share ↑ | pointing ↑ | MoRF AUC ↓ | LeRF AUC ↑ | LeRF − MoRF ↑ | time / forward |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    return "\n".join([
        f"# llm-retrieval ({results['n']} test prompts of seed {results['seed']}), model {results.get('model', '')}",
        "",
        f"The model's greedy next token is the answer on {results['answered']} of {results['n']} prompts (accuracy "
        f"{_cell(results['accuracy'])}); every prompt's true answer is explained. Evidence share: positive relevance "
        "on the supporting fact's tokens over positive relevance on all facts' tokens; pointing: the most relevant "
        "fact token lies in the supporting fact. MoRF / LeRF: the facts' tokens removed most / least relevant first, "
        "area under the answer's log-probability (minus the unperturbed "
        f"{_cell(results['clean_log_probability'], 2)} nats on average) over the removed fraction 0..1.",
        "",
        f"## Prompts answered right ({results['answered']})",
        "",
        *header, *_rows(results["methods"], answered=True),
        "",
        f"## All prompts ({results['n']})",
        "",
        *header, *_rows(results["methods"], answered=False),
        "",
        f"A uniformly random ranking's expected evidence share and pointing (the supporting fact's fraction of the "
        f"facts' tokens): {_cell(results['chance'])}.",
        "",
    ])
