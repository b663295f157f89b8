"""The DETR input type: images, their pixel masks, and one row per explained object (image, query)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DetectionBatch:
    """`pixel_values` (B, 3, H, W) and `pixel_mask` (B, H, W) of the images; `image` and `query` (R,): the
    explained objects, row r is query `query[r]` of image `image[r]` (None until a target binds them)."""

    pixel_values: torch.Tensor
    pixel_mask: torch.Tensor
    image: torch.Tensor | None = None
    query: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.pixel_values) if self.image is None else len(self.image)

    def rows(self, image: torch.Tensor, query: torch.Tensor) -> "DetectionBatch":
        """The same images with the explained objects set."""
        device = self.pixel_values.device
        return DetectionBatch(self.pixel_values, self.pixel_mask, image.to(device), query.to(device))

    def row_images(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, 3, H, W) and (R, H, W): each row's image and mask."""
        if self.image is None:
            return self.pixel_values, self.pixel_mask
        return self.pixel_values[self.image], self.pixel_mask[self.image]
