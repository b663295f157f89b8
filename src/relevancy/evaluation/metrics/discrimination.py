"""Class discrimination on two-object scenes: where does the positive relevance go?

For an image with a target object and another object (boolean pixel masks), a class-discriminative map
puts its positive relevance on the target and little on the other object. Per image:

* ``target_share`` = sum of ``max(map, 0)`` inside the target mask / sum of ``max(map, 0)`` over the image;
* ``other_share`` = the same inside the other object's mask (0 for both when the map has no positive
  relevance);
* ``pointing`` = whether the map's argmax pixel (first one on ties) lies in the target mask.

Maps on the patch grid are upsampled bilinearly to the masks' size first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DiscriminationTest", "class_discrimination"]

_KEYS = ("target_share", "other_share", "pointing")


def class_discrimination(
    maps: torch.Tensor, target_masks: torch.Tensor, other_masks: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-image ``target_share``, ``other_share`` (float64) and ``pointing`` (bool), each ``(B,)``.

    ``maps``: ``(B, h, w)`` (patch grid or pixels); masks: ``(B, H, W)`` bool.
    """
    maps = maps.detach()
    if maps.dim() != 3:
        raise ValueError(f"maps must be (B, h, w), got shape {tuple(maps.shape)}")
    target = target_masks.to(maps.device).bool()
    other = other_masks.to(maps.device).bool()
    maps = maps.double()
    if maps.shape[-2:] != target.shape[-2:]:
        maps = F.interpolate(maps[:, None], size=tuple(target.shape[-2:]), mode="bilinear", align_corners=False)[:, 0]
    positive = maps.clamp(min=0)
    total = positive.sum(dim=(1, 2))
    safe = torch.where(total > 0, total, torch.ones_like(total))
    top = maps.flatten(1).argmax(dim=1)
    return {
        "target_share": ((positive * target).sum(dim=(1, 2)) / safe).cpu(),
        "other_share": ((positive * other).sum(dim=(1, 2)) / safe).cpu(),
        "pointing": target.flatten(1).gather(1, top[:, None])[:, 0].cpu(),
    }


class DiscriminationTest:
    """Accumulates per-image discrimination scores; ``compute()`` averages them over images.

    The per-image lists are summed with ``math.fsum``, so ``merge`` gives exactly the single-process result.
    """

    def __init__(self) -> None:
        self.scores: dict[str, list[float]] = {k: [] for k in _KEYS}

    def update(
        self, maps: torch.Tensor, target_masks: torch.Tensor, other_masks: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Score a batch (see :func:`class_discrimination`), add it and return the per-image scores."""
        s = class_discrimination(maps, target_masks, other_masks)
        for k in _KEYS:
            self.scores[k].extend(float(v) for v in s[k].tolist())
        return s

    def merge(self, other: DiscriminationTest) -> DiscriminationTest:
        """Add ``other``'s images to this accumulator (in place; returns ``self``)."""
        for k in _KEYS:
            self.scores[k].extend(other.scores[k])
        return self

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (for ``torch.distributed.all_gather_object``)."""
        return {k: list(v) for k, v in self.scores.items()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DiscriminationTest:
        """Rebuild an accumulator from :meth:`state_dict`."""
        acc = cls()
        acc.scores = {k: [float(v) for v in state[k]] for k in _KEYS}
        return acc

    def compute(self) -> dict[str, Any]:
        """Means over images of ``target_share``, ``other_share`` and ``pointing`` (the pointing-game accuracy)."""
        n = len(self.scores["pointing"])
        out: dict[str, Any] = {k: math.fsum(v) / n if n else math.nan for k, v in self.scores.items()}
        out["num_images"] = n
        return out
