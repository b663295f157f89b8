"""The ICCV'21 DETR segmentation test on a COCO-format data set: every kept object's relevance map, thresholded by
Otsu and upsampled (`relevancy.evaluation.metrics.detection_masks`), scored as instance segmentation against the data set's
masks with pycocotools (IoU thresholds 0.2..0.95).

Images are read from `images` (a folder; each annotation's `file_name` is relative to it) and processed as DETR's
validation transform does (`transformers.DetrImageProcessor`: shortest side 800, longest at most 1333, ImageNet
normalisation). The model's class indices must be the data set's category ids (true of COCO DETR checkpoints).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import explain
from ..core.extras import require
from .shards import Shards
from .metrics.detection_masks import (
    coco_evaluate, encode_masks, kept_queries, masks_at_size, otsu_mask, query_masks,
)


def image_processor() -> Any:
    """DETR's validation transform (built from its defaults, offline)."""
    return require("transformers", "text").DetrImageProcessor()


def detection_results(model: nn.Module, pixel_values: torch.Tensor, image_id: int, size: tuple[int, int],
                      orig_size: tuple[int, int], method: str) -> list[dict]:
    """The COCO result entries of one image: every query with its score, label and mask (empty when not kept)."""
    with torch.no_grad():
        logits = model(pixel_values=pixel_values).logits[0]
    scores, labels = logits.softmax(-1)[:, :-1].max(-1)
    kept = kept_queries(logits).nonzero()[:, 0].tolist()
    grid_masks = {}
    if kept:
        expl = explain(model, {"pixel_values": pixel_values}, method=method, target=[[(q, int(labels[q])) for q in kept]])
        for row, query in enumerate(expl.query.tolist()):
            grid_masks[query] = otsu_mask(expl.parts["image"].scores[row])
        grid = tuple(expl.parts["image"].scores.shape[-2:])
    else:
        grid = (1, 1)
    masks = masks_at_size(query_masks(grid_masks, len(logits), grid), size, orig_size)
    return [
        {"image_id": image_id, "category_id": int(labels[q]), "score": float(scores[q]), "segmentation": rle}
        for q, rle in enumerate(encode_masks(masks))
    ]


def evaluate_detection_segmentation(
    model: nn.Module, annotation_file: str | Path, images: str | Path, methods: tuple[str, ...], n: int | None = None,
    shards: Shards | None = None, progress: bool = False,
) -> dict[str, Any]:
    """Per method, the COCO segmentation APs of the Otsu masks of its maps over the first `n` images (all: None);
    ``shards``: where each image's record goes as it finishes (`relevancy.evaluation.shards`; default in memory)."""
    from PIL import Image

    COCO = require("pycocotools.coco", "eval").COCO
    processor = image_processor()
    catalogue = COCO(str(annotation_file))
    image_ids = sorted(catalogue.getImgIds())[:n]
    model_dtype = next(model.parameters()).dtype

    def chunk(image_id: int) -> dict[str, Any]:
        """One image's COCO result entries and seconds per method."""
        info = catalogue.loadImgs(image_id)[0]
        with Image.open(Path(images) / info["file_name"]) as picture:
            rgb = picture.convert("RGB")
        batch = processor(images=rgb, return_tensors="pt")
        pixel_values = batch["pixel_values"].to(model_dtype)
        size = tuple(pixel_values.shape[-2:])
        record: dict[str, Any] = {}
        for method in methods:
            started = time.perf_counter()
            entries = detection_results(model, pixel_values, image_id, size, (info["height"], info["width"]), method)
            record[method] = {"entries": entries, "seconds": time.perf_counter() - started}
        return record

    records = (Shards() if shards is None else shards).map(image_ids, chunk, progress, "coco-detr", "img")
    results: dict[str, Any] = {"benchmark": "coco-detr", "annotations": str(annotation_file), "n": len(image_ids), "methods": {}}
    for method in methods:
        results["methods"][method] = {
            "segm": coco_evaluate(str(annotation_file), [e for r in records for e in r[method]["entries"]]),
            "seconds_per_image": math.fsum(r[method]["seconds"] for r in records) / max(len(image_ids), 1),
        }
    return results


def write_detection_report(results: dict[str, Any], out: str | Path) -> list[Path]:
    """results.json and report.md (a table of the APs per method)."""
    from ..core.files import write_atomic

    rows = [
        f"| `{m}` | " + " | ".join(f"{100 * r['segm'][k]:.1f}" for k in ("AP", "AP50", "AP75")) + f" | {r['seconds_per_image']:.2f} |"
        for m, r in results["methods"].items()
    ]
    report = "\n".join([
        f"# DETR segmentation test on {results['annotations']} ({results['n']} images)", "",
        "Otsu masks of each kept object's map (probability > 0.5), COCO instance segmentation, IoU thresholds 0.20-0.95.", "",
        "| method | AP | AP50 | AP75 | s / image |", "| --- | --- | --- | --- | --- |", *rows, "",
    ])
    out = Path(out)
    return [write_atomic(out / "results.json", json.dumps(results, indent=1) + "\n"), write_atomic(out / "report.md", report)]
