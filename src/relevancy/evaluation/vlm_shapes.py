"""`relevancy evaluate --benchmark vlm-shapes`: a vision-language decoder's explanations of the words it writes,
scored against the exact masks of the objects those words name.

1. **Items**: ``make_vlm(n, seed)`` (`relevancy.worlds.vision_language`: unseen scenes of one to three objects, each with a
   description to write or a question to answer). The model answers greedily; ``accuracy`` is the share of exact
   answers. Only answers written exactly right are explained (a wrong word names no object of the ground truth).
2. **Words**: every word of those answers that names an object, its colour or its shape ("a *red* *star* below a
   *blue* *circle*"; "what color is the star" -> "*red*"). Each is explained as the next token after the image, the
   prompt and the answer's words before it (``target``: the word's token id); a method gives ``(B, rows, cols)``
   image scores on the vision tower's patch grid.
3. **Metrics** per word, then means over words (and per word kind, colour or shape):

   * ``share``: the positive relevance inside the named object's mask over the positive relevance of the image (the
     map upsampled bilinearly to the pixels, `relevancy.evaluation.metrics.discrimination.class_discrimination`); 0 for a map
     with no positive value. ``other_share``: the same inside the scene's other objects' masks.
   * ``pointing``: whether the map's top pixel (so its top patch) lies in the object's mask.
   * ``object_iou``, ``function_iou``, ``f1_iou``: TAM's plausibility metrics (`relevancy.evaluation.metrics.plausibility`):
     the IoU of the Otsu-thresholded map with the object's mask; for the answers' words that name nothing (the
     articles and conjunctions of descriptions, `FUNCTION_WORDS`, explained as the object words are), the fraction
     of the map below the answer's object words' mean threshold; their harmonic mean. The maps of one answer are read
     on one scale, that of its object words' maps (the authors' TAM maps are each normalised by TAM itself). The
     authors keep the larger IoU of two words naming the same object; here every word counts.
   * ``morf`` and ``lerf``: patch deletion. The patches are ranked by the map, most relevant first (MoRF) or least
     relevant first (LeRF, ties in patch order); at each step of `STEPS` the first ``int(step * P)`` of the ``P``
     patches are set to the images' mean (0 after normalisation) and the model reads the image again. The curve is
     the word's log-probability minus the unperturbed one (0 at step 0); the value is its trapezoid area over the
     removed fraction 0..1 (`relevancy.evaluation.llm_retrieval`'s deletion test, on patches). MoRF: lower is better;
     LeRF: higher is better; ``gap`` = ``lerf - morf``.
   * ``time_ratio``: a method's time over a plain no-grad forward of the same rows, each having run once untimed:
     what it costs in forward passes.

Reference rows, scored the same way: ``patch_ablation`` (each patch alone set to the mean, the drop of the word's
log-probability: one forward per patch, the slow reference; relevancy's ``token_ablation`` of the patches on the
log-probability), ``random`` (scores drawn uniformly, each chunk's
generator seeded from the seed and its first item) and ``objects`` (word-blind: each patch's share of pixels inside
any object: what finding the objects without reading the word scores).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..families.vision_language.layouts import occluded
from ..worlds.captions import COLORS
from ..worlds.scenes import IMAGE_SIZE
from ..worlds.shapes_vlm import IMAGE_TOKENS, VLM_TEST_SEED, encode, generate, image_token_count, merges_patches, model_inputs
from ..worlds.vision_language import VlmBatch, make_vlm
from .metrics.discrimination import class_discrimination
from .metrics.plausibility import f1_iou, function_iou, grey_levels, object_iou
from .deletion import DIRECTIONS, STEPS, area, curves_of, plan_deletions, ranked
from .llm_retrieval import _cell, _mean
from .shards import Shards
from .support import supported_methods

__all__ = ["DEFAULT_METHODS", "REFERENCES", "UNITS", "FUNCTION_WORDS", "Word", "Explainer", "object_words", "function_words",
           "word_inputs", "for_model", "delete_patches", "word_log_probabilities", "deletion_curves", "patch_ablation",
           "object_cover", "grounding", "plausibility", "evaluate_vlm_shapes", "vlm_report"]

#: relevancy's methods for vision-language decoders, in the order the report lists them (each run where the family offers it)
DEFAULT_METHODS = ("attnlrp", "cp_lrp", "input_x_gradient", "token_activation_map", "transformer_attribution", "generic_attention",
                   "attention_gradcam", "rollout", "raw_attention", "token_ablation")
#: the answers' words that name nothing and that TAM's metric calls function words (determiners, conjunctions; the
#: relation words are prepositions, which the authors leave out)
FUNCTION_WORDS = ("a", "and")
PATCH_ABLATION, RANDOM, OBJECTS = "patch_ablation", "random", "objects"
#: the rows every run adds, computed here
REFERENCES = (PATCH_ABLATION, RANDOM, OBJECTS)
#: the random row's generator of the chunk starting at item ``i`` is seeded ``seed * MAX_ITEMS + i``
MAX_ITEMS = 1_000_000
UNITS = ("share, other_share, pointing, object_iou, function_iou, f1_iou, accuracy: fractions in [0, 1]; morf, lerf, gap: area under the word's "
         "log-probability (nats, minus the unperturbed one) over the removed fraction of the patches (0..1); "
         "clean_log_probability: nats; time_ratio: a method's time over a plain forward of the same rows")
_METRICS = ("share", "other_share", "pointing", "object_iou", "morf", "lerf", "gap")
KINDS = ("color", "shape")
KIND_TITLES = {"color": "Colour words", "shape": "Shape words"}

#: an explainer outside relevancy: (model, inputs with pixel_values, target token ids) -> (B, rows, cols) image scores
Explainer = Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Word:
    """A word of a right answer that names an object: item, its place among the answer's words, the object."""

    item: int
    position: int
    word: str
    obj: int

    @property
    def kind(self) -> str:
        return "color" if self.word in COLORS else "shape"


def object_words(batch: VlmBatch, said: Sequence[str]) -> list[Word]:
    """The words naming an object in the answers ``said`` that are exactly the true ones, in item and word order."""
    return [Word(i, p, w, j) for i, answer in enumerate(said) if answer == batch.answers[i]
            for p, (w, j) in enumerate(zip(answer.split(), batch.named[i])) if j >= 0]


def function_words(batch: VlmBatch, said: Sequence[str]) -> list[Word]:
    """The `FUNCTION_WORDS` of the answers ``said`` that are exactly the true ones (``obj`` -1), in item and word order."""
    return [Word(i, p, w, -1) for i, answer in enumerate(said) if answer == batch.answers[i]
            for p, w in enumerate(answer.split()) if w in FUNCTION_WORDS]


def word_inputs(tokenizer: Any, batch: VlmBatch, words: Sequence[Word], image_tokens: int = IMAGE_TOKENS
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(inputs, targets)``: per word, the ids of ``<s>``, the ``image_tokens`` image tokens, the prompt and the
    answer's words before it (left-padded, as the processor pads for generation), its item's image (normalised
    ``(C, H, W)`` pixel values: what the benchmark deletes patches of; `for_model` makes them the model's inputs), and
    the word's token id."""
    prefixes = [" ".join([batch.prompts[w.item], *batch.answers[w.item].split()[:w.position]]) for w in words]
    inputs = encode(tokenizer, prefixes, image_tokens=image_tokens)
    inputs["pixel_values"] = batch.images[[w.item for w in words]]
    targets = torch.tensor(tokenizer.convert_tokens_to_ids([w.word for w in words]))
    return inputs, targets


def for_model(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The benchmark's ``inputs`` (ids, mask, images) as ``model`` takes them (`relevancy.worlds.shapes_vlm.model_inputs`:
    the LLaVA's as they are, a Qwen2-VL's images as flattened patches with their grid and token types)."""
    ids = {k: v for k, v in inputs.items() if k != "pixel_values"}
    return model_inputs(model.config, ids, inputs["pixel_values"])


def _grid(model: nn.Module) -> tuple[int, int, int]:
    """``(rows, cols, patch)`` of the model's vision tower at its configured image size (the scenes' size for a tower
    without one: a Qwen2-VL's takes any)."""
    vision = model.config.vision_config
    side = getattr(vision, "image_size", IMAGE_SIZE) // vision.patch_size
    return side, side, vision.patch_size


def delete_patches(pixel_values: torch.Tensor, removed: torch.Tensor, patch: int) -> torch.Tensor:
    """A copy of ``pixel_values`` ``(B, C, H, W)`` with the patches ``removed`` ``(B, rows, cols)`` set to 0 (the
    images' mean after normalisation), as ``token_ablation`` occludes them."""
    return occluded(pixel_values, removed, patch)


@torch.no_grad()
def word_log_probabilities(model: nn.Module, inputs: Mapping[str, torch.Tensor], targets: torch.Tensor,
                           pixel_values: torch.Tensor | None = None, batch_size: int = 64) -> torch.Tensor:
    """``(B,)`` float64: the log-probability of ``targets`` after each row of ``inputs`` (left-padded: read at the
    last position; position ids count real tokens only: a Qwen2-VL's 3-D ones its own, from the token types), with
    ``pixel_values`` instead of the inputs' own if given, in forwards of ``batch_size`` rows."""
    pixels = inputs["pixel_values"] if pixel_values is None else pixel_values
    device = next(model.parameters()).device
    out = torch.empty(len(targets), dtype=torch.float64)
    for s in range(0, len(targets), batch_size):
        mask = inputs["attention_mask"][s:s + batch_size]
        rows = for_model(model, {"input_ids": inputs["input_ids"][s:s + batch_size], "attention_mask": mask,
                                 "pixel_values": pixels[s:s + batch_size]})
        if not merges_patches(model.config):
            rows["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(**{k: v.to(device) for k, v in rows.items()}, use_cache=False).logits[:, -1]
        out[s:s + len(mask)] = logits.double().log_softmax(-1).cpu()[torch.arange(len(mask)), targets[s:s + batch_size]]
    return out


def _perturbed(model: nn.Module, inputs: Mapping[str, torch.Tensor], targets: torch.Tensor, rows: torch.Tensor,
               removed: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``(K,)`` float64: the log-probability of row ``rows[k]``'s word with the patches ``removed[k]`` ``(rows,
    cols)`` set to the mean, in forwards of ``batch_size`` (the perturbed images made per forward)."""
    patch = _grid(model)[2]
    out = torch.empty(len(rows), dtype=torch.float64)
    for s in range(0, len(rows), batch_size):
        index = rows[s:s + batch_size]
        part = {k: v[index] for k, v in inputs.items() if k != "pixel_values"}
        pixels = delete_patches(inputs["pixel_values"][index], removed[s:s + batch_size], patch)
        out[s:s + len(index)] = word_log_probabilities(model, part, targets[index], pixels, batch_size)
    return out


def deletion_curves(model: nn.Module, inputs: Mapping[str, torch.Tensor], targets: torch.Tensor,
                    maps: Mapping[str, torch.Tensor], batch_size: int,
                    steps: Sequence[float] = STEPS) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """``(clean, curves)``: each word's unperturbed log-probability ``(B,)`` and, per map name and direction
    (``morf``, ``lerf``), the ``(B, len(steps))`` change of it as the patches are set to the mean in the map's
    order (`relevancy.evaluation.deletion`: each distinct deletion read once)."""
    rows, cols, _ = _grid(model)
    deletions, plan = plan_deletions({name: lambda row, direction, scores=scores: ranked(scores[row].flatten(), direction)
                                      for name, scores in maps.items()}, len(targets), steps)
    removed = torch.zeros(len(deletions), rows * cols, dtype=torch.bool)
    for k, (_, units) in enumerate(deletions):
        removed[k, list(units)] = True
    values = _perturbed(model, inputs, targets, torch.tensor([row for row, _ in deletions]),
                        removed.view(-1, rows, cols), batch_size)
    return curves_of(values, deletions, plan, len(targets))


def patch_ablation(model: nn.Module, inputs: Mapping[str, torch.Tensor], targets: torch.Tensor,
                   batch_size: int = 64) -> torch.Tensor:
    """``(B, rows, cols)`` float64: the drop of each word's log-probability when that patch alone is set to the mean
    (one forward per patch and word, plus the clean one, in forwards of ``batch_size``): relevancy's
    ``token_ablation`` of the image's patches, ``score="log_prob"``."""
    from ..api import explain

    return explain(model, for_model(model, inputs), method="token_ablation", target=targets.tolist(), score="log_prob", ablate="image",
                   chunk_size=batch_size).image_scores.detach().double().cpu()


def object_cover(masks: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``(B, rows, cols)`` float64: each patch's share of pixels inside ``masks`` ``(B, H, W)``."""
    return F.adaptive_avg_pool2d(masks.double()[:, None], (rows, cols))[:, 0]


def grounding(maps: torch.Tensor, target: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per word, float64: ``share``, ``other_share`` and ``pointing`` of ``(B, rows, cols)`` maps against the named
    object's and the other objects' ``(B, H, W)`` masks."""
    d = class_discrimination(maps.detach().double().cpu(), target, other)
    return {"share": d["target_share"], "other_share": d["other_share"], "pointing": d["pointing"].double()}


def plausibility(maps: torch.Tensor, words: Sequence[Word], objects: int, target: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(object IoU per object word, function IoU per function word)`` float64 of ``(W, rows, cols)`` maps, the
    first ``objects`` of ``words`` object words (``target`` their objects' masks ``(objects, H, W)``), the others
    function words: each answer's maps on the scale of its object words' largest value (`grey_levels`)."""
    maps = maps.detach().double().cpu()
    items = [w.item for w in words]
    peak: dict[int, float] = {}  # per answer, its object words' largest value
    for item, value in zip(items[:objects], maps[:objects].clamp_min(0).flatten(1).amax(1).tolist()):
        peak[item] = max(peak.get(item, 0.0), value)
    grey = grey_levels(maps, torch.tensor([peak.get(item, 0.0) for item in items], dtype=torch.float64))
    iou, thresholds = object_iou(grey[:objects], target)
    foreground = {item: thresholds[[k for k in range(objects) if items[k] == item]].mean() for item in peak}
    kept = [k for k in range(objects, len(words)) if items[k] in foreground]
    function = function_iou(grey[kept], torch.stack([foreground[items[k]] for k in kept])) if kept else torch.zeros(0, dtype=torch.float64)
    return iou, function


def evaluate_vlm_shapes(model: nn.Module, processor: Any, methods: Sequence[str] | None = None, n: int = 100,
                        seed: int = VLM_TEST_SEED, batch_size: int = 16, explainers: Mapping[str, Explainer] | None = None,
                        progress: bool = False, deletion_batch_size: int = 128, shards: Shards | None = None,
                        batch: VlmBatch | None = None) -> dict[str, Any]:
    """The benchmark's numbers per method (see the module's docstring), JSON-able (NaN where no word counts).

    ``methods``: relevancy method names (explained through `relevancy.explain`'s ``image_scores``; default those of
    `DEFAULT_METHODS` the model's family offers); ``explainers``:
    more named maps computed outside relevancy, scored the same way; the `REFERENCES` rows are always added.
    ``batch_size``: items per chunk (their words explained together); ``batch``: the items (default
    ``make_vlm(n, seed)``); ``shards``: where each chunk's record goes as it finishes (`relevancy.evaluation.shards`;
    default in memory, one process). The model runs in eval mode; every module's mode is restored after."""
    if min(n, batch_size, deletion_batch_size) < 1:
        raise ValueError(f"n and the batch sizes must be at least 1, got n={n}, batch_size={batch_size}, "
                         f"deletion_batch_size={deletion_batch_size}")
    if methods is None:
        methods = supported_methods(model, DEFAULT_METHODS)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        return _evaluate(model, processor.tokenizer, tuple(methods), dict(explainers or {}), make_vlm(n, seed) if batch is None else batch,
                         seed, batch_size, progress, deletion_batch_size, Shards() if shards is None else shards)
    finally:
        for module, training in modes:
            module.training = training


def _evaluate(model: nn.Module, tokenizer: Any, methods: tuple[str, ...], explainers: dict[str, Explainer],
              batch: VlmBatch, seed: int, batch_size: int, progress: bool, deletion_batch_size: int,
              shards: Shards) -> dict[str, Any]:
    """`evaluate_vlm_shapes` on a model in eval mode: each chunk of items is a chunk of `shards`."""
    from ..api import explain

    rows, cols, _ = _grid(model)
    names = [*methods, *explainers, *REFERENCES]
    warmed: list[bool] = []

    def explain_with(name: str, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        if name in methods:
            return explain(model, for_model(model, inputs), method=name, target=targets.tolist()).image_scores.detach().cpu()
        if name == PATCH_ABLATION:
            return patch_ablation(model, inputs, targets, deletion_batch_size)
        return explainers[name](model, for_model(model, inputs), targets).detach().cpu()

    def chunk(start: int) -> dict[str, Any]:
        """One chunk's record: the answers, then per object word its values, and the chunk's timings."""
        items = range(start, min(len(batch), start + batch_size))
        part = _subset(batch, items)
        said = generate(model, tokenizer, part.images, part.prompts)
        objects = object_words(part, said)
        words = objects + function_words(part, said)
        record: dict[str, Any] = {"right": [a == b for a, b in zip(said, part.answers)], "kinds": [w.kind for w in objects],
                                  "tasks": [part.task_names()[w.item] for w in objects], "seconds": {}, "per_word": {},
                                  "function_iou": {}}
        if not objects:
            return record
        inputs, targets = word_inputs(tokenizer, part, words, image_token_count(model.config))
        if not warmed:  # untimed: each method's and the forward's first call in this process pays one-off costs
            first = {k: v[:1] for k, v in inputs.items()}
            word_log_probabilities(model, first, targets[:1])
            for name in names:
                if name not in (RANDOM, OBJECTS):
                    explain_with(name, first, targets[:1])
            warmed.append(True)
        began = time.perf_counter()
        word_log_probabilities(model, inputs, targets, batch_size=len(targets))
        record["forward_seconds"] = time.perf_counter() - began
        masks = part.masks[[w.item for w in words]]
        target = masks[torch.arange(len(objects)), [w.obj for w in objects]]
        other = masks[:len(objects)].any(1) & ~target
        generator = torch.Generator().manual_seed(seed * MAX_ITEMS + start)
        maps: dict[str, torch.Tensor] = {}
        for name in names:
            began = time.perf_counter()
            if name == RANDOM:
                maps[name] = torch.rand((len(words), rows, cols), generator=generator, dtype=torch.float64)
            elif name == OBJECTS:
                maps[name] = object_cover(masks.any(1), rows, cols)
            else:
                maps[name] = explain_with(name, inputs, targets)
                record["seconds"][name] = time.perf_counter() - began
        n = len(objects)
        object_inputs = {k: v[:n] for k, v in inputs.items()}
        clean, curves = deletion_curves(model, object_inputs, targets[:n], {name: m[:n] for name, m in maps.items()}, deletion_batch_size)
        record["clean"] = clean.tolist()
        for name, scores in maps.items():
            morf, lerf = (area(curves[name][d]) for d in DIRECTIONS)
            values = {k: v.tolist() for k, v in grounding(scores[:n], target, other).items()}
            iou, function = plausibility(scores, words, n, target)
            record["per_word"][name] = {**values, "object_iou": iou.tolist(), "morf": morf.tolist(), "lerf": lerf.tolist(),
                                        "gap": (lerf - morf).tolist()}
            record["function_iou"][name] = function.tolist()
        return record

    starts = list(range(0, len(batch), batch_size))
    records = shards.map(starts, chunk, progress, "vlm-shapes", "item", lambda s: len(range(s, min(len(batch), s + batch_size))))
    kinds = [k for r in records for k in r["kinds"]]
    tasks = [t for r in records for t in r["tasks"]]
    right = [v for r in records for v in r["right"]]
    timed = [r for r in records if "forward_seconds" in r]
    forward_seconds = math.fsum(r["forward_seconds"] for r in timed)
    results: dict[str, Any] = {
        "benchmark": "vlm-shapes", "n": len(batch), "seed": seed, "units": UNITS, "steps": list(STEPS),
        "grid": [rows, cols], "accuracy": _mean(right), "answered": int(sum(right)), "words": len(kinds),
        "words_per_kind": {k: kinds.count(k) for k in KINDS},
        "function_words": sum(len(r["function_iou"].get(names[0], [])) for r in timed),
        "words_per_task": {t: tasks.count(t) for t in dict.fromkeys(tasks)},
        "clean_log_probability": _mean([v for r in timed for v in r["clean"]]), "methods": {},
    }
    for name in names:
        per_word = {k: [v for r in timed for v in r["per_word"][name][k]] for k in _METRICS}
        entry: dict[str, Any] = {k: _mean(v) for k, v in per_word.items()}
        entry["function_iou"] = _mean([v for r in timed for v in r["function_iou"][name]])
        entry["f1_iou"] = f1_iou(entry["object_iou"], entry["function_iou"])
        entry["per_kind"] = {kind: {k: _mean([v for v, w in zip(per_word[k], kinds) if w == kind]) for k in _METRICS}
                             for kind in KINDS}
        for values in entry["per_kind"].values():  # the function words are of no kind: their mean is the answer's
            values["function_iou"] = entry["function_iou"]
            values["f1_iou"] = f1_iou(values["object_iou"], entry["function_iou"])
        if name in (RANDOM, OBJECTS):
            results["methods"][name] = entry
            continue
        seconds = math.fsum(r["seconds"][name] for r in timed)
        entry["time_ratio"] = seconds / forward_seconds if forward_seconds else math.nan
        entry["seconds_per_word"] = seconds / max(len(kinds), 1)
        results["methods"][name] = entry
    return results


def _subset(batch: VlmBatch, items: range) -> VlmBatch:
    """The items ``items`` of ``batch``."""
    i = list(items)
    return VlmBatch(prompts=[batch.prompts[k] for k in i], answers=[batch.answers[k] for k in i], task=batch.task[i],
                    named=[batch.named[k] for k in i], images=batch.images[i], pixels=batch.pixels[i],
                    masks=batch.masks[i], n_objects=batch.n_objects[i], shape=batch.shape[i], color=batch.color[i],
                    seed=batch.seed)


#: the report's columns, in order, and those shown as percentages
_COLUMNS = ("share", "other_share", "pointing", "object_iou", "function_iou", "f1_iou", "morf", "lerf", "gap")
_PERCENT = ("share", "other_share", "pointing", "object_iou", "function_iou", "f1_iou")
_LABELS = {PATCH_ABLATION: "patch ablation (reference)", RANDOM: "random scores", OBJECTS: "all objects (word-blind)"}


def _rows(methods: Mapping[str, Any], kind: str | None = None) -> list[str]:
    out = []
    for name, entry in methods.items():
        values = entry if kind is None else entry["per_kind"][kind]
        ratio = _cell(entry["time_ratio"], 1) if "time_ratio" in entry else "0"
        cells = " | ".join(_cell(100 * values[k], 1) if k in _PERCENT else _cell(values[k], 2) for k in _COLUMNS)
        out.append(f"| {_LABELS.get(name, f'`{name}`')} | {cells} | {ratio} |")
    return out


def vlm_report(results: Mapping[str, Any]) -> str:
    """The results as Markdown: all object words, then per kind of word."""
    header = ["| method | share % ↑ | other objects % ↓ | pointing % ↑ | obj IoU % ↑ | func IoU % ↑ | F1-IoU % ↑ | MoRF ↓ | LeRF ↑ "
              "| LeRF − MoRF ↑ | forwards |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    kinds = results["words_per_kind"]
    return "\n".join([
        f"# vlm-shapes ({results['n']} unseen scenes of seed {results['seed']}), model {results.get('model', '')}",
        "",
        f"The model's greedy answer is exactly right on {results['answered']} of {results['n']} items (accuracy "
        f"{_cell(100 * results['accuracy'], 1)} %); their {results['words']} words naming an object "
        f"({kinds['color']} colour words, {kinds['shape']} shape words) are explained, each as the next token after "
        "the image, the prompt and the words before it. Share: positive relevance inside the named object's mask over "
        "the image's (other objects: inside the scene's other objects' masks); pointing: the top patch lies in the "
        "object. Obj IoU: the Otsu-thresholded map against the object's mask; func IoU: the share of the map of the "
        f"answers' {results['function_words']} articles and conjunctions below their object words' mean threshold; "
        "F1-IoU: the harmonic mean of the two (TAM's metrics; per kind of word, func IoU is all answers'). MoRF / LeRF: patches set to the mean most / least relevant first, area under the word's "
        "log-probability (minus the unperturbed "
        f"{_cell(results['clean_log_probability'], 2)} nats on average) over the removed fraction 0..1. Forwards: a "
        "method's time over a plain forward of the same rows.",
        "",
        *header, *_rows(results["methods"]),
        "",
        *[line for kind in KINDS for line in (f"## {KIND_TITLES[kind]} ({kinds[kind]})", "", *header,
                                               *_rows(results["methods"], kind), "")],
    ])
