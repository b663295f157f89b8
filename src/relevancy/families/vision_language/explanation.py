"""A vision-language decoder's explanation: the prompt's text tokens and the image, both for one explained token."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ...explanation import PAGE_SUFFIXES, PICTURE_SUFFIXES, DecoderExplanation, save_overlays
from ...parts import ImagePart, TextPart


@dataclass
class VisionLanguageExplanation(DecoderExplanation):
    """Relevance of each prompt token (`scores` `(B, T)`: 0 at the image's placeholder tokens, whose relevance is the
    image's) and of the image (`image_scores` `(B, rows, cols)` on the vision tower's patch grid: each patch's pixels
    summed; `pixel_scores` `(B, H, W)`: per pixel, summed over the colour channels) for the explained token.
    `relevance_total`: the share of the explained score reaching text and image together; `image_share` `(B,)`:
    the image's share of the absolute relevance. `heatmap()`: the patch scores upsampled to the image's pixels."""

    image_scores: torch.Tensor | None = None
    pixel_scores: torch.Tensor | None = field(default=None, repr=False)
    image_tokens: torch.Tensor | None = field(default=None, repr=False)  # (B, T) bool: the image's placeholder tokens

    part_fields: ClassVar[dict[str, str]] = {"text": "scores", "image": "image_scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES + PAGE_SUFFIXES

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        return {**super().parts, "image": ImagePart(self.image_scores, self.signed, tuple(self.pixel_scores.shape[-2:]))}

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the patch scores upsampled bilinearly to the image's pixels (raw values)."""
        return self.parts["image"].heatmap()

    @property
    def image_share(self) -> torch.Tensor:
        """`(B,)`: the image's share of the absolute relevance of pixels and text tokens together."""
        image = self.pixel_scores.abs().flatten(1).sum(1)
        return image / (image + self.scores.abs().sum(1))

    def picture(self, path: Path, images: torch.Tensor | None) -> Path:
        """The image part as an overlay PNG, one panel per row (`images`: the rows' `pixel_values`, where given)."""
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.labels()])
