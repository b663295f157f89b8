"""What a DETR explanation holds: one map per explained object (a row), with the image and query it belongs to."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...explanation import Explanation


@dataclass
class DetectionExplanation(Explanation):
    """`scores` (R, h, w): the relevance of every image token for row r's object, query `query[r]` of image
    `image[r]`, class `target[r]`; `logits` (R, C + 1) are that query's class logits (the last: "no object").
    `relevance_total` (LRP-based methods, `(R, 2)`): the relevance reaching the encoder's input tokens and the
    decoder's zero queries; image + 2 x queries = 1 (see `families.detr.rules`)."""

    image: torch.Tensor = field(default=None, repr=False)
    query: torch.Tensor = field(default=None, repr=False)

    def labels(self) -> list[str]:
        """A caption per object: image, query, class name and its logit."""
        names = self.class_names or []
        return [
            f"image {i}, query {q}: {names[k] if k < len(names) else f'class {k}'} ({self.logits[r, k]:.2f})"
            for r, (i, q, k) in enumerate(zip(self.image.tolist(), self.query.tolist(), self.target.tolist()))
        ]

    def save(self, path: str | Path, images=None, boxes: torch.Tensor | None = None) -> Path:
        """An overlay PNG, one panel per object: `images` the explained images, normalised (B, 3, H, W) as given to
        explain or as pictures (B, H, W, 3) uint8 (each row is drawn over its own image); `boxes` (R, 4) x0, y0, x1,
        y1 in pixels (e.g. `detect`'s)."""
        from ...viz import overlay_figure, save_figure

        part = self.parts["image"]
        pictures = None
        if images is not None:
            images = torch.as_tensor(images)
            if images.dtype == torch.uint8:
                pictures = images[self.image.cpu()].float() / 255
            else:
                pictures = part.pixels(images[self.image])
        titles = [f"{self.method}\n{label}" for label in self.labels()]
        return save_figure(overlay_figure(part.heatmap().cpu(), pictures, part.signed, titles, boxes), path)
