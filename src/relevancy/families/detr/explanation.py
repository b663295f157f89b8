"""What a DETR explanation holds: one map per explained object (a row), with the image and query it belongs to."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...explanation import Explanation


@dataclass
class DetectionExplanation(Explanation):
    """`scores` (R, h, w): the relevance of every image token for row r's object, query `query[r]` of image
    `image[r]`, class `target[r]`; `logits` (R, C + 1) are that query's class logits (the last: "no object")."""

    image: torch.Tensor = field(default=None, repr=False)
    query: torch.Tensor = field(default=None, repr=False)

    def labels(self) -> list[str]:
        """A caption per object: image, query, class name and its logit."""
        names = self.class_names or []
        return [
            f"image {i} query {q}: {names[k] if k < len(names) else f'class {k}'} ({self.logits[r, k]:.2f})"
            for r, (i, q, k) in enumerate(zip(self.image.tolist(), self.query.tolist(), self.target.tolist()))
        ]
