"""The input of the vision-language decoders: a tokenised batch with one image per row (what a processor returns)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..text_batch import TextBatch


@dataclass(frozen=True)
class ImageTextTokens(TextBatch):
    """A processor's output on the model's device: the tokens (image placeholders among them) and each row's image,
    `pixel_values` `(B, C, H, W)` (Idefics3 / SmolVLM: `(B, 1, C, H, W)`) in the model's dtype; `pixel_attention_mask`
    where the processor gave one (Idefics3)."""

    pixel_values: torch.Tensor | None = None
    pixel_attention_mask: torch.Tensor | None = None

    def rows(self, part: slice) -> "ImageTextTokens":
        """The rows of `part`, every field sliced alike."""
        mask = self.pixel_attention_mask
        return replace(super().rows(part), pixel_values=self.pixel_values[part], pixel_attention_mask=None if mask is None else mask[part])

    @property
    def image_size(self) -> tuple[int, int]:
        """`(H, W)` of the images."""
        return tuple(self.pixel_values.shape[-2:])
