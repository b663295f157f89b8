"""Segmentation test on ImageNet-Segmentation (Chefer et al., CVPR'21).

Protocol of the authors' ``baselines/ViT/imagenet_seg_eval.py`` with ``utils/metrices.py``
(``batch_pix_accuracy``, ``batch_intersection_union``, ``get_ap_scores``), one image at a time:

* the map is upsampled bilinearly to the mask size and min-max normalised: ``R = (R - min) / (max - min)``;
* the hard mask is ``R > mean(R)`` (foreground) against ``R <= mean(R)`` (background); the argmax over the
  two channels picks background where both are 0 (a constant map gives NaNs, hence all background);
* pixel accuracy = correct / labeled pixels, IoU per class = intersection / union (background and
  foreground), both accumulated over the dataset as integers and divided with ``np.spacing(1)`` added to
  the denominator; mIoU = mean of the two IoUs;
* AP of one image = ``sklearn.metrics.average_precision_score`` over *both* channels pooled: scores
  ``1 - R`` labelled ``mask == 0`` and ``R`` labelled ``mask == 1`` (``2 * H * W`` samples, float32, NaN
  scores set to 0, a NaN AP set to 0); mAP = mean over images.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...core.extras import require

__all__ = ["SegmentationTest", "segmentation_scores"]

_EPS = float(np.spacing(1, dtype=np.float64))


def normalised_maps(maps: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``(B, H, W)`` maps upsampled to ``size`` (bilinear) and min-max normalised per image."""
    maps = maps.detach()
    if maps.dim() != 3:
        raise ValueError(f"maps must be (B, h, w), got shape {tuple(maps.shape)}")
    if not maps.is_floating_point():
        maps = maps.float()
    if tuple(maps.shape[-2:]) != size:
        maps = F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    lo = maps.amin(dim=(1, 2), keepdim=True)
    hi = maps.amax(dim=(1, 2), keepdim=True)
    return (maps - lo) / (hi - lo)


def _average_precision(res: torch.Tensor, mask: torch.Tensor) -> float:
    """The authors' ``get_ap_scores`` for one image: AP of both channels' scores pooled."""
    average_precision_score = require("sklearn.metrics", extra="eval").average_precision_score

    scores = torch.stack((1 - res, res)).nan_to_num(0.0).reshape(-1).cpu().numpy()
    truth = torch.stack((mask == 0, mask == 1)).reshape(-1).cpu().numpy().astype(np.int64)
    return float(np.nan_to_num(average_precision_score(truth, scores)))


def segmentation_scores(maps: torch.Tensor, masks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-image sufficient statistics of the segmentation test.

    ``maps``: ``(B, h, w)`` relevance (patch grid or pixels); ``masks``: ``(B, H, W)`` ground truth, 1 =
    object, 0 = background. Returns ``correct``, ``labeled`` ``(B,)``, ``intersection``, ``union``
    ``(B, 2)`` (background, foreground) as int64 and ``ap`` ``(B,)`` float64.
    """
    masks = masks.to(maps.device).long()
    res = normalised_maps(maps, tuple(masks.shape[-2:]))
    foreground = res > res.mean(dim=(1, 2), keepdim=True)  # NaN maps compare False: background
    pred = foreground.long()
    correct = (pred == masks).sum(dim=(1, 2))
    labeled = (masks >= 0).sum(dim=(1, 2))
    inter = torch.stack([((pred == c) & (masks == c)).sum(dim=(1, 2)) for c in (0, 1)], dim=1)
    area_pred = torch.stack([(pred == c).sum(dim=(1, 2)) for c in (0, 1)], dim=1)
    area_mask = torch.stack([(masks == c).sum(dim=(1, 2)) for c in (0, 1)], dim=1)
    ap = torch.tensor([_average_precision(r, m) for r, m in zip(res, masks)], dtype=torch.float64)
    return {
        "correct": correct.cpu(),
        "labeled": labeled.cpu(),
        "intersection": inter.cpu(),
        "union": (area_pred + area_mask - inter).cpu(),
        "ap": ap,
    }


class SegmentationTest:
    """Accumulates pixel counts and per-image APs; ``compute()`` gives pixel accuracy, mIoU and mAP.

    Integer counts and the list of APs (summed with ``math.fsum``) make ``merge`` exact.
    """

    def __init__(self) -> None:
        self.correct = 0
        self.labeled = 0
        self.intersection = [0, 0]
        self.union = [0, 0]
        self.ap: list[float] = []

    def update(self, maps: torch.Tensor, masks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Score a batch (see :func:`segmentation_scores`), add it and return the per-image scores."""
        s = segmentation_scores(maps, masks)
        self.correct += int(s["correct"].sum())
        self.labeled += int(s["labeled"].sum())
        self.intersection = [a + int(b) for a, b in zip(self.intersection, s["intersection"].sum(0))]
        self.union = [a + int(b) for a, b in zip(self.union, s["union"].sum(0))]
        self.ap.extend(s["ap"].tolist())
        return s

    def merge(self, other: SegmentationTest) -> SegmentationTest:
        """Add ``other``'s images to this accumulator (in place; returns ``self``)."""
        self.correct += other.correct
        self.labeled += other.labeled
        self.intersection = [a + b for a, b in zip(self.intersection, other.intersection)]
        self.union = [a + b for a, b in zip(self.union, other.union)]
        self.ap.extend(other.ap)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (for ``torch.distributed.all_gather_object``)."""
        return {
            "correct": self.correct,
            "labeled": self.labeled,
            "intersection": list(self.intersection),
            "union": list(self.union),
            "ap": list(self.ap),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SegmentationTest:
        """Rebuild an accumulator from :meth:`state_dict`."""
        acc = cls()
        acc.correct, acc.labeled = int(state["correct"]), int(state["labeled"])
        acc.intersection = [int(v) for v in state["intersection"]]
        acc.union = [int(v) for v in state["union"]]
        acc.ap = [float(v) for v in state["ap"]]
        return acc

    def compute(self) -> dict[str, Any]:
        """``pixel_accuracy``, ``iou`` ([background, foreground]), ``miou``, ``map`` (all in [0, 1])."""
        iou = [i / (_EPS + u) for i, u in zip(self.intersection, self.union)]
        return {
            "pixel_accuracy": self.correct / (_EPS + self.labeled),
            "iou": iou,
            "miou": sum(iou) / 2,
            "map": math.fsum(self.ap) / len(self.ap) if self.ap else math.nan,
            "num_images": len(self.ap),
        }
