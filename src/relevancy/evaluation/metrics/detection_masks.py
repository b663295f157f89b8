"""The ICCV'21 DETR segmentation protocol (the authors' `mask_generator.py` and DETR's `PostProcessSegm`): each
kept object's relevance map becomes a mask by an Otsu threshold, is upsampled to the image, and the masks are
scored as COCO instance segmentation with IoU thresholds from 0.2.

Steps, as the authors run them:

1. keep the queries whose best class (not "no object") has softmax probability > 0.5;
2. per kept query: min-max the map to 0..255, cast to uint8 (truncating; a constant map gives NaN, cast to 0),
   Otsu threshold as OpenCV computes it, mask = 255 above the threshold; queries not kept are -1;
3. bilinear upsampling of the (Q, h, w) masks to the processed image size, on where the value is > 0 (their
   `sigmoid() > 0.5`), crop, nearest-neighbour resize to the original size;
4. COCO evaluation of every query's mask with its score and label, IoU thresholds 0.20, 0.25, ..., 0.95.

OpenCV's Otsu is written out here (a few lines) rather than depending on OpenCV: its tie-breaking and its skipping
of empty classes decide masks on the small maps DETR gives (a 3 x 4 grid has few distinct values).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...core.extras import require

KEEP_THRESHOLD = 0.5
# the authors edit pycocotools' IoU thresholds to 0.20:0.05:0.95 (16 values; AP50 and AP75 stay members)
IOU_THRESHOLDS = np.linspace(0.2, 0.95, int(np.round((0.95 - 0.2) / 0.05)) + 1, endpoint=True)
FLT_EPSILON = float(np.finfo(np.float32).eps)


def otsu_threshold(values: np.ndarray) -> int:
    """OpenCV's `THRESH_OTSU` on uint8 values: the `t` in 0..255 maximising `q1 q2 (mu1 - mu2)^2` with class 1 the
    values <= t; the first maximum wins, `t` is skipped while a class holds less than FLT_EPSILON of the mass,
    and 0 is returned when no `t` qualifies."""
    histogram = np.bincount(np.asarray(values, dtype=np.uint8).ravel(), minlength=256).astype(np.float64)
    probability = histogram / histogram.sum()
    mean_all = float((np.arange(256) * probability).sum())
    q1 = mu1_sum = 0.0
    best_t, best = 0, 0.0
    for t in range(256):
        q1 += probability[t]
        mu1_sum += t * probability[t]
        q2 = 1.0 - q1
        if min(q1, q2) < FLT_EPSILON or max(q1, q2) > 1.0 - FLT_EPSILON:
            continue
        mu1 = mu1_sum / q1
        mu2 = (mean_all - mu1_sum) / q2
        spread = q1 * q2 * (mu1 - mu2) ** 2
        if spread > best:
            best_t, best = t, spread
    return best_t


def to_uint8(scores: torch.Tensor) -> np.ndarray:
    """Min-max to 0..255 and cast to uint8 as numpy does on x86 (truncation; NaN from a constant map -> 0)."""
    values = scores.detach().double().cpu().numpy()
    span = values.max() - values.min()
    scaled = (values - values.min()) / span * 255 if span > 0 else np.zeros_like(values)
    return scaled.astype(np.uint8)


def otsu_mask(scores: torch.Tensor) -> np.ndarray:
    """A map (h, w) -> uint8 mask, 255 where the min-maxed map is above its Otsu threshold, else 0."""
    values = to_uint8(scores)
    return np.where(values > otsu_threshold(values), 255, 0).astype(np.uint8)


def kept_queries(logits: torch.Tensor, threshold: float = KEEP_THRESHOLD) -> torch.Tensor:
    """(Q,) bool: the queries whose best class, not "no object", has softmax probability > `threshold`."""
    return logits.softmax(-1)[..., :-1].max(-1).values > threshold


def query_masks(grid_masks: dict[int, np.ndarray], queries: int, grid: tuple[int, int]) -> torch.Tensor:
    """(1, Q, h, w) float32: the Otsu masks of the kept queries (0/255), -1 for the others (as `mask_generator`)."""
    masks = -torch.ones(1, queries, *grid, dtype=torch.float32)
    for query, mask in grid_masks.items():
        masks[0, query] = torch.from_numpy(mask.astype(np.float32))
    return masks


def masks_at_size(masks: torch.Tensor, size: tuple[int, int], orig_size: tuple[int, int]) -> torch.Tensor:
    """DETR's `PostProcessSegm`: (1, Q, h, w) -> (Q, H_orig, W_orig) uint8 0/1. Bilinear to the processed size,
    on where > 0, crop to it, nearest-neighbour to the original size."""
    upsampled = F.interpolate(masks, size=tuple(size), mode="bilinear", align_corners=False)
    on = (upsampled.sigmoid() > 0.5)[0, :, : size[0], : size[1]]
    return F.interpolate(on[:, None].float(), size=tuple(orig_size), mode="nearest")[:, 0].byte()


def coco_evaluate(annotation_file: str, results: list[dict], iou_type: str = "segm") -> dict[str, float]:
    """COCO evaluation of `results` (pycocotools format, RLE `segmentation` or `bbox`) with the authors' IoU
    thresholds: AP (mean over 0.20..0.95), AP50, AP75, and the small/medium/large APs."""
    COCO = require("pycocotools.coco", "eval").COCO
    COCOeval = require("pycocotools.cocoeval", "eval").COCOeval
    truth = COCO(annotation_file)
    if not results:
        return {name: 0.0 for name in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large")}
    evaluator = COCOeval(truth, truth.loadRes(results), iou_type)
    evaluator.params.iouThrs = IOU_THRESHOLDS
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    stats = evaluator.stats
    return {"AP": stats[0], "AP50": stats[1], "AP75": stats[2], "AP_small": stats[3], "AP_medium": stats[4], "AP_large": stats[5]}


def encode_masks(masks: torch.Tensor) -> list[dict]:
    """(Q, H, W) 0/1 -> COCO run-length encodings (pycocotools), counts as str for JSON."""
    coco_mask = require("pycocotools.mask", "eval")
    array = np.asfortranarray(masks.numpy().astype(np.uint8).transpose(1, 2, 0))
    encoded = coco_mask.encode(array)
    for rle in encoded:
        rle["counts"] = rle["counts"].decode("ascii")
    return encoded
