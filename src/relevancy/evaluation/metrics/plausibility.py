"""TAM's plausibility metrics (Li et al., ICCV 2025, their `eval.py`): how well a thresholded map covers the object a
word names, and how empty the maps of words that name nothing stay.

* ``object IoU`` (their Obj-IoU): the map, as 8-bit grey values and upsampled bilinearly to the mask's size, split
  by Otsu's threshold as OpenCV computes it (`detection_masks.otsu_threshold`, the DETR test's); the intersection
  over union of the pixels above it with the named object's mask.
* ``function IoU`` (their Func-IoU): for a word that names nothing (an article, a conjunction), the fraction of its
  map's cells below the foreground threshold, the mean of the Otsu thresholds of the object words' maps of the
  same answer: a map that stays below what the object words call foreground is "right" everywhere.
* ``F1 IoU``: the harmonic mean of the mean object IoU and the mean function IoU.

The authors' maps are TAM's, each already in [0, 255]. For any method, `grey_levels` puts the maps of one answer
on one scale: their positive part over the largest value of the answer's object-word maps, times 255, as uint8
(function words' maps above it clipped at 255), so that a function word's map is read on its object words' scale.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .detection_masks import otsu_threshold

__all__ = ["grey_levels", "object_iou", "function_iou", "f1_iou"]


def grey_levels(maps: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(B, h, w)` maps as uint8 grey values: the positive part over `scale` `(B,)` (its row's largest object-word
    value), times 255, truncated and clipped to [0, 255] (rows of scale 0: all 0)."""
    scale = scale.double()[:, None, None]
    grey = torch.where(scale > 0, maps.double().clamp_min(0) / torch.where(scale > 0, scale, 1.0) * 255, 0.0)
    return grey.clamp(0, 255).to(torch.uint8)


def object_iou(grey: torch.Tensor, masks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(IoU (B,), threshold (B,))`: each uint8 map `(B, h, w)` upsampled bilinearly to its mask's size `(B, H, W)`
    (rounded to grey levels, as an 8-bit resize is), split at its Otsu threshold, against the mask."""
    up = F.interpolate(grey.double()[:, None], size=tuple(masks.shape[-2:]), mode="bilinear", align_corners=False)[:, 0]
    up = up.round().clamp(0, 255).to(torch.uint8)
    thresholds = torch.tensor([otsu_threshold(row.numpy()) for row in up.cpu()], dtype=torch.float64)
    found = up > thresholds.to(torch.uint8)[:, None, None]
    masks = masks.bool()
    union = (found | masks).flatten(1).sum(1)
    iou = (found & masks).flatten(1).sum(1).double() / union.clamp_min(1)
    return iou, thresholds


def function_iou(grey: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """`(B,)`: the fraction of each uint8 map's cells `(B, h, w)` below its answer's foreground threshold `(B,)`."""
    return (grey.double() < thresholds.double()[:, None, None]).flatten(1).double().mean(1)


def f1_iou(object_mean: float, function_mean: float) -> float:
    """The harmonic mean of the mean object IoU and the mean function IoU (0 where both are 0, NaN where either is)."""
    total = object_mean + function_mean
    if math.isnan(total):
        return math.nan
    return 2 * object_mean * function_mean / total if total > 0 else 0.0
