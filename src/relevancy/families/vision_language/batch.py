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


@dataclass(frozen=True)
class GridImageTextTokens(ImageTextTokens):
    """Qwen2-VL's processor output on the model's device: the tokens and each row's image as its flattened patches,
    `pixel_values` `(B, t * h * w, C * T * P * P)` (the processor's `(patches, ...)` split per row: one image per row,
    every image of the same grid), `image_grid_thw` `(B, 3)` each row's patch grid, `patch` the patch's side."""

    image_grid_thw: torch.Tensor | None = None
    patch: int = 14

    def rows(self, part: slice) -> "GridImageTextTokens":
        return replace(super().rows(part), image_grid_thw=self.image_grid_thw[part])

    @property
    def image_size(self) -> tuple[int, int]:
        """`(H, W)` of the images as the processor resized them (the patch grid's rows and columns times the patch)."""
        _, rows, cols = self.image_grid_thw[0].tolist()
        return rows * self.patch, cols * self.patch


@dataclass(frozen=True)
class SizedImageTextTokens(ImageTextTokens):
    """A processor's output whose images come with their sizes: `image_sizes` `(B, 2)` each row's image's `(height,
    width)` (one size per batch), which the model's forward reads beside the pixels (Mistral 3's `(B, C, H, W)`)."""

    image_sizes: torch.Tensor | None = None

    def rows(self, part: slice) -> "SizedImageTextTokens":
        return replace(super().rows(part), image_sizes=self.image_sizes[part])

    @property
    def image_size(self) -> tuple[int, int]:
        """`(H, W)` of the images (LLaVA-NeXT's before tiling: the heat map's size)."""
        return tuple(self.image_sizes[0].tolist())


@dataclass(frozen=True)
class TiledImageTextTokens(SizedImageTextTokens):
    """LLaVA-NeXT's and LLaVA-OneVision's processor output on the model's device: the tokens and each row's image as
    its tiles, `pixel_values` `(B, tiles, C, H, W)` (the base image, the image downscaled to one tile, first),
    `image_sizes` `(B, 2)` each row's image's `(height, width)` before tiling (one size per batch)."""


@dataclass(frozen=True)
class TileGridTokens(ImageTextTokens):
    """InternVL's processor output on the model's device: the tokens and each row's image as its tiles, `pixel_values`
    `(B, tiles, C, H, W)` in the processor's order (the grid's tiles row by row, then, where there are several, the
    thumbnail: the whole image at one tile's size), `grid` `(rows, cols)` the tiles' arrangement (`(1, 1)`: one tile,
    no thumbnail), `size` the images' `(height, width)` before tiling (`image_sizes`; None where not given)."""

    grid: tuple[int, int] = (1, 1)
    size: tuple[int, int] | None = None

    @property
    def image_size(self) -> tuple[int, int]:
        """`(H, W)` of the images: their size before tiling where given, else the tile's."""
        return self.size or tuple(self.pixel_values.shape[-2:])
