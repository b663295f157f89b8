"""`relevancy evaluate --benchmark shapes-clip`: does an image-text explanation point at the object a caption names?

Two-object shapes scenes never seen in training; each is paired with a caption naming ONE of its objects by size,
colour and shape ("a small red star"), object 0 for even scenes and object 1 for odd ones. Each method explains
the pair's logit; on the image side its positive relevance (upsampled to pixels) is compared with the two
objects' exact masks, on the text side its token scores with the words that single the object out (its colour
and its shape):

* ``own_share`` / ``other_share``: the share of the map's positive relevance on the named object / on the other
  object (the rest lies on the background);
* ``pointing`` / ``pointing_other``: how often the map's largest pixel lies on the named / the other object;
* ``iou``: the named object's IoU with the map thresholded at its mean (the segmentation test's binarisation);
* ``token_f1``: F1 of the two highest-scoring caption words (start and end tokens left out) against
  {colour, shape}.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .metrics.segmentation import normalised_maps
from .data import scene_seed
from .shards import Shards, fsum_dicts

#: (label, method, options): `generic_attention` in both of the authors' settings
VARIANTS = {
    "generic_attention": (("generic_attention", "generic_attention", {"start_layer": -1}),
                          ("generic_attention_all_layers", "generic_attention", {"start_layer": 0})),
}
TOP_K_WORDS = 2


@dataclass(frozen=True)
class GroundingScenes:
    """Scenes with the caption naming one object: `images (n, 3, H, W)`, `named`/`other` masks `(n, H, W)`,
    `captions`, and per caption the token positions of the words that single the object out."""

    images: torch.Tensor
    named: torch.Tensor
    other: torch.Tensor
    captions: list[str]
    naming_positions: list[set[int]]


def grounding_scenes(indices: Sequence[int], seed: int, tokenizer) -> GroundingScenes:
    """Scene `i` of the benchmark's pair set (unseen seeds, see `evaluation.data.scene_seed`), captioned."""
    from ..worlds.captions import COLORS, SIZES, attribute_arrays, object_phrase
    from ..worlds.scenes import CLASSES, make_scenes

    images, named, other, captions, naming = [], [], [], [], []
    for i in indices:
        scenes = make_scenes(1, seed=scene_seed(seed, "pair", i), objects=2)
        attributes = attribute_arrays(scenes)
        j = i % 2
        shape, colour = CLASSES[int(attributes["shape"][0, j])], COLORS[int(attributes["color"][0, j])]
        caption = object_phrase(shape, colour, SIZES[int(attributes["size"][0, j])])
        words = tokenizer.tokens(tokenizer.encode([caption])["input_ids"])[0]
        images.append(scenes.images[0])
        named.append(scenes.masks[0, j])
        other.append(scenes.masks[0, 1 - j])
        captions.append(caption)
        naming.append({k for k, w in enumerate(words) if w in (shape, colour)})
    return GroundingScenes(torch.stack(images), torch.stack(named), torch.stack(other), captions, naming)


def image_scores(heatmap: torch.Tensor, named: torch.Tensor, other: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per scene: own/other share of positive relevance, pointing hits, IoU of the mean-thresholded map."""
    positive = heatmap.double().clamp(min=0)
    total = positive.flatten(1).sum(1)
    share = lambda mask: torch.where(total > 0, (positive * mask).flatten(1).sum(1) / total.clamp(min=1e-300), 0.0)  # noqa: E731
    peak = heatmap.flatten(1).argmax(1)
    res = normalised_maps(heatmap, tuple(named.shape[-2:]))
    foreground = res > res.mean(dim=(1, 2), keepdim=True)
    intersection = (foreground & named).flatten(1).sum(1)
    union = (foreground | named).flatten(1).sum(1)
    return {
        "own_share": share(named),
        "other_share": share(other),
        "pointing": named.flatten(1).gather(1, peak[:, None])[:, 0].double(),
        "pointing_other": other.flatten(1).gather(1, peak[:, None])[:, 0].double(),
        "iou": intersection.double() / union.double(),
    }


def token_f1(text_scores: torch.Tensor, ends: torch.Tensor, naming: list[set[int]], k: int = TOP_K_WORDS) -> torch.Tensor:
    """Per caption: F1 of its `k` best-scoring words (positions 1..end-1) against the naming positions."""
    out = []
    for row, end, truth in zip(text_scores, ends.tolist(), naming):
        words = row[1:end].double()
        top = {1 + int(p) for p in words.argsort(descending=True, stable=True)[:k]}
        hits = len(top & truth)
        precision, recall = hits / len(top), hits / len(truth)
        out.append(0.0 if hits == 0 else 2 * precision * recall / (precision + recall))
    return torch.tensor(out, dtype=torch.float64)


def evaluate_grounding(
    model: nn.Module, tokenizer, methods: Sequence[str], n: int, seed: int = 0, batch_size: int = 16, progress: bool = False,
    shards: Shards | None = None,
) -> dict[str, Any]:
    """The benchmark's numbers per method (means over `n` scenes, fractions in [0, 1]) and seconds per pair;
    ``shards``: where each batch's record goes as it finishes (`relevancy.evaluation.shards`; default in memory)."""
    from ..api import explain
    from ..families.clip.batch import ImageTextBatch

    variants = [v for m in methods for v in VARIANTS.get(m, ((m, m, {}),))]

    def chunk(indices: range) -> dict[str, Any]:
        """The record of one batch of scenes: the objects' areas, each variant's sums and seconds."""
        data = grounding_scenes(indices, seed, tokenizer)
        encoded = tokenizer.encode(data.captions)
        batch = ImageTextBatch.of(data.images, encoded)
        record: dict[str, Any] = {"named": float(data.named.flatten(1).double().mean(1).sum()),
                                  "other": float(data.other.flatten(1).double().mean(1).sum()), "sums": {}, "seconds": {}}
        for label, method, options in variants:
            started = time.perf_counter()
            expl = explain(model, batch, method=method, **options)
            record["seconds"][label] = time.perf_counter() - started
            values = image_scores(expl.heatmap().cpu(), data.named, data.other)
            values["token_f1"] = token_f1(expl.parts["text"].scores.cpu(), expl.readout, data.naming_positions)
            record["sums"][label] = {name: float(per_scene.sum()) for name, per_scene in values.items()}
        return record

    batches = [range(s, min(n, s + batch_size)) for s in range(0, n, batch_size)]
    records = (Shards() if shards is None else shards).map(batches, chunk, progress, "shapes-clip", "scene", len)
    sums = {label: fsum_dicts([r["sums"][label] for r in records]) for label, _, _ in variants}
    seconds = {label: math.fsum(r["seconds"][label] for r in records) for label, _, _ in variants}
    areas = {key: math.fsum(r[key] for r in records) for key in ("named", "other")}
    chance = {"named": areas["named"] / n, "other": areas["other"] / n}
    return {
        "benchmark": "shapes-clip", "n": n, "seed": seed,
        # a uniform map: shares and pointing hits equal the objects' areas as fractions of the image
        "chance": {"own_share": chance["named"], "other_share": chance["other"], "pointing": chance["named"],
                   "pointing_other": chance["other"]},
        "methods": {
            label: {**{name: total / n for name, total in sums[label].items()}, "seconds_per_pair": seconds[label] / n}
            for label in sums
        },
    }


def grounding_report(results: dict[str, Any]) -> str:
    """The results as a Markdown table (percentages)."""
    columns = ("own_share", "other_share", "pointing", "pointing_other", "iou", "token_f1")
    rows = [
        f"| `{label}` | " + " | ".join(f"{100 * values[c]:.1f}" for c in columns) + f" | {1000 * values['seconds_per_pair']:.1f} |"
        for label, values in results["methods"].items()
    ]
    return "\n".join([
        f"# shapes-clip grounding ({results['n']} unseen two-object scenes, seed {results['seed']}), model {results.get('model', '')}",
        "",
        "Each scene is paired with a caption naming one of its two objects (\"a small red star\"); every method explains",
        "the pair's logit. Image side, in %: share of positive relevance on the named / the other object, pointing game",
        "on the named / the other object, IoU of the mean-thresholded map with the named object. Text side: token-F1",
        f"of the top-{TOP_K_WORDS} caption words against the object's colour and shape words.",
        "",
        "| method | own share | other share | pointing | pointing other | IoU | token-F1 | ms / pair |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "| uniform map (chance) | " + " | ".join(f"{100 * results['chance'][c]:.1f}" if c in results["chance"] else "" for c in columns) + " | |",
        "",
    ])
