"""`relevancy evaluate --benchmark shapes-detection`: explanations of a DETR detector scored against exact masks.

The scenes are the shapes detection world's (`relevancy.worlds.detection.make_detection_scenes`: one, two or three
objects of distinct classes, a third each; pixel-exact masks and tight boxes), never seen in training (seed
``DETECTION_TEST_SEED + --seed``). The detector (`load_detector`: the shipped `DetrForObjectDetection` or a
checkpoint of it) sees each 64 x 64 image through an 8 x 8 grid of image tokens.

1. **Detections**: the authors' rule, every query whose best class (not "no object") has softmax probability
   > ``threshold`` (0.5). Each detection is matched to a ground-truth object by its box: per image, detections in
   order of decreasing probability each take the not yet taken object of highest box IoU, if that IoU is >= 0.5
   (class not required; ``class_correct`` counts the matched detections of the right class).
2. **Maps**: every detection of a batch of images is explained by each method in one `explain` call, for its
   query and its detected class; the map is the image part, one score per token (8 x 8).
3. **Metrics**, per method over the matched detections (each against its own object's exact mask):

   * ``segmentation``, the authors' DETR segmentation test (ICCV'21, their `mask_generator.py` with DETR's
     `PostProcessSegm`; `relevancy.evaluation.metrics.detection_masks`): the token map is min-maxed to 0..255, cast to uint8,
     thresholded by Otsu (OpenCV's rule) at token resolution, the 0/255 mask upsampled bilinearly to 64 x 64 and
     switched on where > 0. Against the object's mask (object = 1, everything else = 0): ``pixel_accuracy`` =
     correct pixels / all pixels, ``iou`` = [background IoU, object IoU], each intersection / union, with the
     pixel counts summed over all matched detections before dividing (as the CVPR'21 segmentation test
     accumulates them); ``miou`` = the mean of the two IoUs. ``map`` = mean over detections of the CVPR'21
     segmentation test's AP (`relevancy.evaluation.metrics.segmentation`): the continuous token map upsampled bilinearly to
     64 x 64 and min-maxed to R in [0, 1], ``average_precision_score`` over both channels pooled (R labelled
     object, 1 - R labelled background; 2 x 64 x 64 samples). On these small objects (about 4 % of the image)
     that pooled AP is dominated by the background channel: a constant or random map scores about 0.5, but any
     map that is low over most of the image scores high wherever its peak is (the exact mask of *another*
     object of the scene scores 0.89 on average). So ``object_ap`` is reported beside it: the same AP on the
     object channel alone (R against the object's pixels; chance: the object's area). ``object_iou`` is
     ``iou[1]``.
   * ``segmentation_mean_threshold``: pixel accuracy, IoUs and mIoU as above but with the CVPR'21 binarisation
     (upsampled min-maxed map > its mean), for comparison with the ViT benchmarks.
   * ``coco_segm``: COCO instance segmentation (pycocotools, the authors' IoU thresholds 0.20..0.95) of the Otsu
     masks of *all* detections (matched or not) with their probabilities and classes against the exact masks:
     ``AP`` (mean over the IoU thresholds), ``AP50``, ``AP75``. The authors also hand in the queries below the
     threshold with empty masks: they rank below every kept detection and match nothing, so they cannot change
     any AP and are left out.
   * ``pointing``: the share of detections whose map maximum (the token map upsampled bilinearly to 64 x 64; the
     first pixel on ties) lies inside the object's mask; ``pointing_other``: inside another object's mask
     (scenes with >= 2 objects).
   * shares of the positive relevance (the upsampled map clamped at 0; all three 0 for a map with no positive
     value, counted in ``empty_maps``): ``own_share`` on the detected object (all matched detections),
     ``other_share`` on the scene's other objects (only scenes with >= 2 objects), ``background_share`` on no
     object (all matched detections). Means over detections.

   ``chance``: what a uniform map scores: the object's area as a fraction of the image (``own_share``,
   ``pointing``, ``object_ap``), the other objects' (``other_share``, ``pointing_other``, scenes with >= 2
   objects), the background's (``background_share``), averaged over the same detections; and
   ``chance.empty_mask``: the segmentation numbers of an empty mask (a constant map): pixel accuracy and
   background IoU = the pooled background share, object IoU 0, mIoU half the pixel accuracy, mAP 0.5.

   Before its first timed call each method explains the first batch once untimed (first calls pay one-off
   costs: lazy imports, the feature grid's measurement).

Every fraction is in [0, 1]. ``seconds_per_image``: the method's `explain` time over all ``n`` images (images
without detections cost nothing), ``seconds_per_object`` over the detections explained.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..api import explain
from ..worlds.detection import DETECTION_TEST_SEED, detector_inputs, make_detection_scenes
from ..families.detr import detect
from .metrics.detection_masks import coco_evaluate, encode_masks, masks_at_size, otsu_mask
from .metrics.discrimination import class_discrimination
from ..core.extras import require
from .metrics.segmentation import SegmentationTest, normalised_maps
from .shards import Shards
from .support import supported_methods

__all__ = [
    "DETECTION_THRESHOLD", "MATCH_IOU", "UNITS", "detection_report", "evaluate_shapes_detection", "match_detections",
    "object_ap", "otsu_masks", "placement_scores", "supported_methods",
]

DETECTION_THRESHOLD = 0.5
MATCH_IOU = 0.5
UNITS = "fractions in [0, 1] (report.md shows them in percent); seconds_per_image, seconds_per_object: seconds"
_EPS = float(np.spacing(1, dtype=np.float64))



def match_detections(boxes: torch.Tensor, scores: torch.Tensor, truth: torch.Tensor, min_iou: float = MATCH_IOU) -> list[int | None]:
    """Per detection (boxes ``(d, 4)`` xyxy, ``scores (d,)``), the index of its ground-truth box in ``truth (k, 4)``
    or None: in order of decreasing score (stable on ties) each detection takes the untaken box of highest IoU,
    if that IoU is >= ``min_iou``."""
    from torchvision.ops import box_iou

    matched: list[int | None] = [None] * len(boxes)
    if len(boxes) == 0 or len(truth) == 0:
        return matched
    iou = box_iou(boxes.double(), truth.double())
    taken: set[int] = set()
    for d in torch.argsort(scores, descending=True, stable=True).tolist():
        free = [g for g in torch.argsort(iou[d], descending=True, stable=True).tolist() if g not in taken]
        if free and iou[d, free[0]] >= min_iou:
            taken.add(free[0])
            matched[d] = free[0]
    return matched


def otsu_masks(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The authors' masks of ``(k, h, w)`` maps: Otsu at the maps' resolution, bilinear to ``size``, on where > 0:
    ``(k, H, W)`` uint8 0/1."""
    grid = np.stack([otsu_mask(m) for m in maps.detach().cpu()]).astype(np.float32)
    return masks_at_size(torch.from_numpy(grid)[None], size, size)


def _counts(pred: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Summed pixel counts of binary predictions ``(k, H, W)`` against masks: correct, labeled, and per class
    (background, object) intersection and union."""
    pred, mask = pred.bool(), mask.bool()
    inter = [int((~pred & ~mask).sum()), int((pred & mask).sum())]
    union = [int((~pred | ~mask).sum()), int((pred | mask).sum())]
    return {"correct": int((pred == mask).sum()), "labeled": mask.numel(), "intersection": inter, "union": union}


def object_ap(maps: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Per map ``(k, h, w)``: the AP of its upsampled min-maxed scores (NaN, from a constant map, as 0) against the
    object's pixels ``own (k, H, W)`` alone (float64)."""
    average_precision_score = require("sklearn.metrics", extra="eval").average_precision_score

    res = normalised_maps(maps.float(), tuple(own.shape[-2:])).nan_to_num(0.0)
    return torch.tensor([float(np.nan_to_num(average_precision_score(m.flatten().numpy().astype(np.int64), r.flatten().numpy())))
                         for r, m in zip(res.cpu(), own.cpu())], dtype=torch.float64)


def placement_scores(maps: torch.Tensor, own: torch.Tensor, others: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per map ``(k, h, w)`` against the detected object's mask ``own (k, H, W)`` and the union of the scene's other
    objects ``others (k, H, W)``: ``own_share``, ``other_share``, ``background_share`` (float64), ``pointing``,
    ``pointing_other`` (bool), ``empty`` (no positive relevance). Maps are upsampled bilinearly to the masks."""
    own, others = own.bool(), others.bool()
    background = ~(own | others)
    on_object = class_discrimination(maps, own, others)
    on_others = class_discrimination(maps, others, background)
    return {
        "own_share": on_object["target_share"],
        "other_share": on_object["other_share"],
        "background_share": on_others["other_share"],
        "pointing": on_object["pointing"],
        "pointing_other": on_others["pointing"],
        "empty": ~(maps.detach().flatten(1) > 0).any(1).cpu(),
    }


class _MethodRecord:
    """One method's accumulators over the matched detections, and its COCO result entries."""

    def __init__(self) -> None:
        self.otsu = {"correct": 0, "labeled": 0, "intersection": [0, 0], "union": [0, 0]}
        self.mean_threshold = SegmentationTest()
        self.values: dict[str, list[float]] = {k: [] for k in ("own_share", "background_share", "pointing", "empty", "object_ap")}
        self.multi: dict[str, list[float]] = {k: [] for k in ("other_share", "pointing_other")}
        self.coco: list[dict] = []
        self.seconds = 0.0
        self.objects = 0

    def add(self, maps: torch.Tensor, own: torch.Tensor, others: torch.Tensor, multi: torch.Tensor) -> None:
        counts = _counts(otsu_masks(maps, tuple(own.shape[-2:])), own)
        for key in ("correct", "labeled"):
            self.otsu[key] += counts[key]
        for key in ("intersection", "union"):
            self.otsu[key] = [a + b for a, b in zip(self.otsu[key], counts[key])]
        self.mean_threshold.update(maps.float(), own.long())
        s = placement_scores(maps, own, others)
        s["object_ap"] = object_ap(maps, own)
        for key in self.values:
            self.values[key].extend(float(v) for v in s[key].tolist())
        for key in self.multi:
            self.multi[key].extend(float(v) for v, m in zip(s[key].tolist(), multi.tolist()) if m)

    def state(self) -> dict[str, Any]:
        """Plain state (a chunk's record of this method)."""
        return {"otsu": self.otsu, "mean_threshold": self.mean_threshold.state_dict(), "values": self.values,
                "multi": self.multi, "coco": self.coco, "seconds": self.seconds, "objects": self.objects}

    def merge(self, state: dict[str, Any]) -> None:
        """Add a chunk's :meth:`state` (chunks merged in order give the one-process lists)."""
        for key in ("correct", "labeled"):
            self.otsu[key] += state["otsu"][key]
        for key in ("intersection", "union"):
            self.otsu[key] = [a + b for a, b in zip(self.otsu[key], state["otsu"][key])]
        self.mean_threshold.merge(SegmentationTest.from_state(state["mean_threshold"]))
        for own, other in ((self.values, state["values"]), (self.multi, state["multi"])):
            for key in own:
                own[key].extend(other[key])
        self.coco.extend(state["coco"])
        self.seconds += state["seconds"]
        self.objects += state["objects"]

    def results(self, coco: dict[str, float]) -> dict[str, Any]:
        o = self.otsu
        iou = [i / (_EPS + u) for i, u in zip(o["intersection"], o["union"])]
        mt = self.mean_threshold.compute()
        mean = lambda v: math.fsum(v) / len(v) if v else math.nan  # noqa: E731
        return {
            "segmentation": {"pixel_accuracy": o["correct"] / (_EPS + o["labeled"]) if o["labeled"] else math.nan,
                             "miou": sum(iou) / 2 if o["labeled"] else math.nan, "iou": iou if o["labeled"] else [math.nan] * 2,
                             "map": mt["map"], "object_iou": iou[1] if o["labeled"] else math.nan,
                             "object_ap": mean(self.values["object_ap"]), "num_objects": mt["num_images"]},
            "segmentation_mean_threshold": {k: mt[k] for k in ("pixel_accuracy", "miou", "iou")},
            "coco_segm": {k: float(coco[k]) for k in ("AP", "AP50", "AP75")},
            "pointing": mean(self.values["pointing"]),
            "pointing_other": mean(self.multi["pointing_other"]),
            "own_share": mean(self.values["own_share"]),
            "other_share": mean(self.multi["other_share"]),
            "background_share": mean(self.values["background_share"]),
            "empty_maps": int(sum(self.values["empty"])),
            "seconds_per_image": math.nan,  # set by the caller
            "seconds_per_object": self.seconds / self.objects if self.objects else math.nan,
        }


def _truth_file(folder: Path, scenes, size: tuple[int, int]) -> Path:
    """The scenes' exact masks as a COCO instances file."""
    from ..worlds.scenes import CLASSES

    images, annotations = [], []
    for i, (labels, boxes, masks) in enumerate(zip(scenes.labels, scenes.boxes, scenes.masks)):
        images.append({"id": i, "height": size[0], "width": size[1]})
        for label, box, rle, area in zip(labels.tolist(), boxes.tolist(), encode_masks(masks.byte()), masks.flatten(1).sum(1).tolist()):
            annotations.append({"id": len(annotations) + 1, "image_id": i, "category_id": int(label), "segmentation": rle,
                                "area": float(area), "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]], "iscrowd": 0})
    path = folder / "truth.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": k, "name": name} for k, name in enumerate(CLASSES)]}))
    return path


def evaluate_shapes_detection(
    model: nn.Module, n: int = 200, methods: Sequence[str] | None = None, threshold: float = DETECTION_THRESHOLD,
    seed: int = DETECTION_TEST_SEED, batch_size: int = 16, progress: bool = False, shards: Shards | None = None,
) -> dict[str, Any]:
    """The benchmark's numbers per method (see the module's docstring); JSON-able, NaN where nothing was matched.
    ``methods``: default every method the model's family offers (:func:`supported_methods`); ``shards``: where each
    batch's record goes as it finishes (`relevancy.evaluation.shards`; default in memory, one process)."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be at least 1, got n={n}, batch_size={batch_size}")
    if methods is None:
        methods = supported_methods(model)
    model.eval()
    scenes = make_detection_scenes(n, seed)
    size = tuple(scenes.images.shape[-2:])
    warm: set[str] = set()

    def chunk(start: int) -> dict[str, Any]:
        """The record of the scenes ``start .. start + batch_size - 1``: counts, areas, each method's state."""
        records = {m: _MethodRecord() for m in methods}
        counts = dict.fromkeys(("detected", "matched", "class_correct", "matched_in_multi_object_scenes"), 0)
        areas: dict[str, list[float]] = {"own": [], "background": [], "other": []}
        index = list(range(start, min(n, start + batch_size)))
        inputs = detector_inputs(scenes.images[index])
        found = detect(model, inputs, threshold)
        with_objects = [j for j, per_image in enumerate(found) if per_image]
        if not with_objects:
            return {"counts": counts, "areas": areas, "methods": {m: r.state() for m, r in records.items()}}
        # per explained row: scene, detection, matched object (or None)
        rows: list[tuple[int, Any, int | None]] = []
        for j in with_objects:
            i = index[j]
            boxes = torch.tensor([d.box for d in found[j]], dtype=torch.float64)
            scores = torch.tensor([d.score for d in found[j]], dtype=torch.float64)
            for d, g in zip(found[j], match_detections(boxes, scores, scenes.boxes[i])):
                rows.append((i, d, g))
                if g is not None:
                    counts["matched"] += 1
                    counts["class_correct"] += int(d.label == int(scenes.labels[i][g]))
                    counts["matched_in_multi_object_scenes"] += int(len(scenes.labels[i]) > 1)
        counts["detected"] += len(rows)
        matched = [r for r, (_, _, g) in enumerate(rows) if g is not None]
        own = torch.stack([scenes.masks[rows[r][0]][rows[r][2]] for r in matched]) if matched else None
        if own is not None:
            all_objects = [scenes.masks[rows[r][0]].any(0) for r in matched]
            others = torch.stack([a & ~o for a, o in zip(all_objects, own)])
            multi = torch.tensor([len(scenes.labels[rows[r][0]]) > 1 for r in matched])
            areas["own"] += own.flatten(1).double().mean(1).tolist()
            areas["background"] += (~torch.stack(all_objects)).flatten(1).double().mean(1).tolist()
            areas["other"] += [a for a, m in zip(others.flatten(1).double().mean(1).tolist(), multi.tolist()) if m]
        sub = {k: v[with_objects] for k, v in inputs.items()}
        targets = [[(d.query, d.label) for d in found[j]] for j in with_objects]
        for method, record in records.items():
            if method not in warm:  # one-off costs of a method's first call in this process stay out of its timing
                explain(model, sub, method=method, target=targets)
                warm.add(method)
            started = time.perf_counter()
            expl = explain(model, sub, method=method, target=targets)
            record.seconds += time.perf_counter() - started
            record.objects += len(rows)
            order = {(with_objects[int(j)], int(q)): k for k, (j, q) in enumerate(zip(expl.image.tolist(), expl.query.tolist()))}
            maps = expl.parts["image"].scores.detach().float().cpu()
            maps = maps[[order[(index.index(i), d.query)] for i, d, _ in rows]]
            for (i, d, _), rle in zip(rows, encode_masks(otsu_masks(maps, size))):
                record.coco.append({"image_id": i, "category_id": d.label, "score": d.score, "segmentation": rle})
            if matched:
                record.add(maps[matched], own, others, multi)
        return {"counts": counts, "areas": areas, "methods": {m: r.state() for m, r in records.items()}}

    starts = list(range(0, n, batch_size))
    chunks = (Shards() if shards is None else shards).map(starts, chunk, progress, "shapes-detection", "scene",
                                                        lambda start: len(range(start, min(n, start + batch_size))))
    records = {m: _MethodRecord() for m in methods}
    counts = {"objects": sum(len(x) for x in scenes.labels), "detected": 0, "matched": 0, "class_correct": 0,
              "matched_in_multi_object_scenes": 0}
    areas: dict[str, list[float]] = {"own": [], "background": [], "other": []}
    for record in chunks:
        for key, value in record["counts"].items():
            counts[key] += value
        for key, value in record["areas"].items():
            areas[key] += value
        for method, state in record["methods"].items():
            records[method].merge(state)
    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints
        truth = str(_truth_file(Path(folder), scenes, size))
        coco = {m: coco_evaluate(truth, r.coco) for m, r in records.items()}
    mean = lambda v: math.fsum(v) / len(v) if v else math.nan  # noqa: E731
    # an empty mask gets every background pixel right: pixel accuracy = background IoU = 1 - pooled object area
    empty_accuracy = 1.0 - mean(areas["own"]) if areas["own"] else math.nan
    methods_out = {}
    for method, record in records.items():
        methods_out[method] = record.results(coco[method])
        methods_out[method]["seconds_per_image"] = record.seconds / n
    return {
        "benchmark": "shapes-detection", "n": n, "seed": seed, "threshold": threshold, "units": UNITS,
        "detection": {**counts, "unmatched": counts["detected"] - counts["matched"]},
        "chance": {"own_share": mean(areas["own"]), "pointing": mean(areas["own"]), "object_ap": mean(areas["own"]),
                   "other_share": mean(areas["other"]), "pointing_other": mean(areas["other"]),
                   "background_share": mean(areas["background"]),
                   "empty_mask": {"pixel_accuracy": empty_accuracy, "miou": empty_accuracy / 2,
                                  "object_iou": 0.0 if areas["own"] else math.nan, "map": 0.5 if areas["own"] else math.nan}},
        "methods": methods_out,
    }


def _pct(value: Any, decimals: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{100 * value:.{decimals}f}"


def detection_report(results: dict[str, Any]) -> str:
    """The results as Markdown tables (percentages)."""
    d, chance = results["detection"], results["chance"]
    seg_keys = ("pixel_accuracy", "miou", "object_iou", "map", "object_ap")
    seg_rows = [
        f"| `{m}` | " + " | ".join(_pct(v["segmentation"][k]) for k in seg_keys) + " | "
        + " | ".join(_pct(v["coco_segm"][k]) for k in ("AP", "AP50", "AP75")) + f" | {1000 * v['seconds_per_image']:.1f} |"
        for m, v in results["methods"].items()
    ]
    empty = {**chance["empty_mask"], "object_ap": chance["object_ap"]}
    place_keys = ("pointing", "pointing_other", "own_share", "other_share", "background_share")
    place_rows = [
        f"| `{m}` | " + " | ".join(_pct(v[k]) for k in place_keys) + f" | {v['empty_maps']} |"
        for m, v in results["methods"].items()
    ]
    return "\n".join([
        f"# shapes-detection ({results['n']} unseen scenes of 1-3 objects, seed {results['seed']}), model {results.get('model', '')}",
        "",
        f"{d['detected']} detections (best class probability > {results['threshold']}) of {d['objects']} objects; "
        f"{d['matched']} matched to an object (box IoU >= {MATCH_IOU}, greedy by probability), {d['class_correct']} of "
        f"them of the right class, {d['matched_in_multi_object_scenes']} in scenes of 2-3 objects. Every detection is "
        "explained for its query and class; the metrics are over the matched detections, each against its object's "
        "pixel-exact mask, in %.",
        "",
        "Segmentation, the authors' DETR test: Otsu mask of the 8 x 8 token map, upsampled to 64 x 64 as DETR's "
        "PostProcessSegm; its pixel accuracy, mIoU (mean of object and background IoU) and object IoU, pixel counts "
        "pooled over detections. mAP: the CVPR'21 segmentation test's AP of the continuous upsampled map (object and "
        "background channels pooled), object AP: the object channel alone; means over detections. COCO mask AP "
        "(IoU 0.20-0.95), AP50, AP75 of all detections' Otsu masks.",
        "",
        "| method | pixel acc | mIoU | object IoU | mAP | object AP | COCO AP | AP50 | AP75 | ms / image |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *seg_rows,
        "| empty mask, constant map (chance) | " + " | ".join(_pct(empty[k]) for k in seg_keys) + " | 0.0 | 0.0 | 0.0 | |",
        "",
        "Placement: pointing game (the upsampled map's maximum on the detected object / on another object), and the "
        "share of positive relevance on the detected object, on the other objects (scenes of 2-3 objects only) and "
        "on the background; empty: maps with no positive relevance (all shares 0).",
        "",
        "| method | pointing | pointing other | own share | other share | background share | empty maps |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *place_rows,
        "| uniform map (chance) | " + " | ".join(_pct(chance[k]) for k in place_keys) + " | |",
        "",
    ])
