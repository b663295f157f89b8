"""InternVL (`InternVLForConditionalGeneration`: InternVL 3 / 3.5 in transformers' layout), unmodified, with one tile per
image or with the processor's tiles: its image processor (GotOcr2's, `crop_to_patches=True`, its default) resizes an
image onto the grid of up to `max_patches` tiles of the tower's size whose aspect is the image's closest, cuts it
into those tiles row by row and, where there is more than one, adds a thumbnail (the whole image at one tile's size)
after them; each tile goes through the tower, pixel shuffle and projector on its own, and its tokens fill its
`image_seq_length` placeholders in that order. What differs from the other layouts is `layouts.INTERNVL`'s.

Inputs are the processor's output, `pixel_values` `(B * tiles, 3, S, S)` (every row one image of the same tile
count); the tiles' arrangement is not in it (the processor drops its `num_patches`), so several tiles need the
images' size before tiling, `image_sizes` `(B, 2)` (height, width; one size per call) added to the inputs, from which
transformers' own `get_optimal_tiled_canvas` gives the grid. The maps: the grid's tiles laid side by side as the
picture holds them (`image_scores` `(B, rows * side, cols * side)`), the thumbnail's apart (`base_scores`), the pixels
per tile (`pixel_scores` `(B, tiles, S, S)`, the processor's order); one tile keeps the other layouts' shapes.
TAM filters each tile's token grid apart; a generation's inputs get the picture's size as `image_sizes`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...core.streams import Feed
from ..causal_lm.adapter import CausalLMAdapter
from .adapter import VisionLanguageAdapter
from .batch import TileGridTokens
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation
from .layouts import INTERNVL, is_vision_language, layout_named, pixel_patches, tiles_on_grid, tokens_on_patches

#: what an InternVL processor's output may hold, and the images' sizes relevancy takes beside it
INTERNVL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "mm_token_type_ids", "labels")


class InternVLAdapter(VisionLanguageAdapter):
    family = "InternVL vision-language decoder"
    layouts = (INTERNVL,)
    examples = "transformers " + ", ".join(INTERNVL.classes)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return is_vision_language(model) and layout_named(model) in cls.layouts

    @staticmethod
    def image_size_inputs(size: tuple[int, int]) -> dict[str, torch.Tensor]:
        """A generation's `image_sizes` `(1, 2)`, the picture's (height, width): the tiles' grid for `check_inputs`."""
        return {"image_sizes": torch.tensor([size])}

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> TileGridTokens:
        """A `TileGridTokens` on the model's device from the processor's output (and `image_sizes`); a one-line error
        for pixels that are not whole rows of tiles of the tower's size, placeholders that are not every tile's, rows
        of other sizes, several tiles without `image_sizes`, before the model's own error."""
        if not isinstance(inputs, Mapping) or not {"pixel_values", "input_ids"} <= set(inputs):
            got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            raise TypeError(f"inputs must be the processor's output, a dict with input_ids, attention_mask and pixel_values; got {got}")
        unknown = sorted(set(inputs) - set(INTERNVL_KEYS))
        if unknown:
            raise ValueError(f"the processor's output holds {', '.join(unknown)}, which relevancy does not take; it takes {', '.join(INTERNVL_KEYS)}")
        text = CausalLMAdapter.check_inputs(self, {key: inputs[key] for key in ("input_ids", "attention_mask") if key in inputs})
        pixels, side = inputs["pixel_values"], self.side * self.patch
        if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point():
            raise TypeError(f"pixel_values must be a float tensor (the processor's output), got {type(pixels).__name__}")
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != (3, side, side) or len(pixels) % len(text) or not len(pixels):
            raise ValueError(f"pixel_values must be (B * tiles, 3, H, W): every row's image as the processor's tiles of the tower's size "
                             f"{side} x {side}, the same count per row (B = {len(text)}); got {tuple(pixels.shape)}")
        tiles = len(pixels) // len(text)
        placeholders = (text.input_ids == self.image_token).sum(1)
        if (placeholders != tiles * self.image_tokens).any():
            raise ValueError(f"input_ids must hold {tiles} tile(s)' {tiles * self.image_tokens} placeholder tokens (id {self.image_token}, "
                             f"{self.image_tokens} per tile) in every row; counted per row: {placeholders.tolist()}: make the inputs with the "
                             "model's processor, one image per row, processor(images=image, text=prompt)")
        size = self.image_sizes(inputs.get("image_sizes"), len(text))
        dtype, device = next(self.model.parameters()).dtype, text.input_ids.device
        return TileGridTokens(**{name: getattr(text, name) for name in ("input_ids", "attention_mask", "tokens", "word_ids")},
                              pixel_values=pixels.to(device, dtype).unflatten(0, (len(text), tiles)), grid=self.grid(tiles, size),
                              size=size)

    @staticmethod
    def image_sizes(given: object, rows: int) -> tuple[int, int] | None:
        """The images' `(height, width)` from `image_sizes` `(B, 2)` (None where not given); a one-line error for
        another shape or rows of different sizes."""
        if given is None:
            return None
        sizes = torch.as_tensor(given)
        if tuple(sizes.shape) != (rows, 2) or sizes.is_floating_point() or bool((sizes < 1).any()):
            raise ValueError(f"image_sizes must be (B, 2) = ({rows}, 2): each row's image's (height, width) in pixels before tiling; "
                             f"got {sizes.tolist()}")
        if bool((sizes != sizes[:1]).any()):
            raise ValueError(f"the rows' images have different sizes (image_sizes {sizes.tolist()}): relevancy explains one per call; "
                             "explain each size in a call of its own (or resize the images to one size)")
        return tuple(sizes[0].tolist())

    def grid(self, tiles: int, size: tuple[int, int] | None) -> tuple[int, int]:
        """`(rows, cols)` of `tiles` tiles (the thumbnail among them where more than one) of an image of `size`: the
        arrangement of `tiles - 1` tiles the processor's `get_optimal_tiled_canvas` chooses for that size (among
        those of that count, whatever its `min_patches` and `max_patches`: the one it chose had the closest aspect)."""
        if tiles == 1:
            return 1, 1
        if tiles == 2:
            raise ValueError("pixel_values hold 2 tiles per image: InternVL's processor gives one tile, or several and their thumbnail")
        if size is None:
            raise ValueError(f"{tiles} tiles per image (the processor's crop_to_patches): their arrangement comes from the image's size, "
                             "which InternVL's processor does not return: add image_sizes, (B, 2) each image's (height, width) before "
                             "tiling, to the inputs (or give one tile per image, crop_to_patches=False)")
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

        tile = self.side * self.patch
        cols, rows = get_optimal_tiled_canvas(size, (tile, tile), tiles - 1, tiles - 1)
        return rows, cols

    # -- running ----------------------------------------------------------------------------------------------
    @staticmethod
    def model_pixels(pixels: torch.Tensor) -> torch.Tensor:
        """The rows' tiles `(R, tiles, C, H, W)` one after the other, as the model takes them: `(R * tiles, C, H, W)`."""
        return pixels.flatten(0, 1)

    def feeds(self, inputs: TileGridTokens) -> list[Feed]:
        """The tower's feed of the image's tokens (`VisionLanguageAdapter.feeds`), each row's from its tiles, which the
        tower runs one after the other."""
        return [replace(feed, tiles=inputs.pixel_values.shape[1]) for feed in super().feeds(inputs)]

    def patch_grid(self, inputs: TileGridTokens) -> tuple[int, int]:
        """Token ablation's units: every tile's patches, the tiles' grids one under the other `(tiles * side, side)`."""
        return inputs.pixel_values.shape[1] * self.side, self.side

    def pixel_relevance(self, relevance: torch.Tensor, inputs: TileGridTokens) -> torch.Tensor:
        """The pixels' relevance summed over the colour channels: `(R, tiles, H, W)`, one tile's `(R, H, W)`."""
        summed = relevance.sum(-3)
        return summed[:, 0] if summed.shape[1] == 1 else summed

    def image_token_grids(self, inputs: TileGridTokens) -> tuple[tuple[torch.Tensor, tuple[int, int]], ...]:
        """TAM's grids apart, one per tile (the thumbnail's last): its k x k pixel-shuffled tokens among the image's
        placeholders, row-major, the tiles' one after the other (`image_token_grid`, each tile's)."""
        rows, cols = self.image_token_grid(inputs)
        device = inputs.input_ids.device
        return tuple((torch.arange(tile * rows * cols, (tile + 1) * rows * cols, device=device), (rows, cols))
                     for tile in range(inputs.pixel_values.shape[1]))

    def image_token_map(self, on_tokens: torch.Tensor, inputs: TileGridTokens) -> torch.Tensor:
        """Scores of the image's tokens `(B, tiles * tokens)` laid back on each tile's patches (`tokens_on_patches`),
        the tiles' grids one under the other: `(B, tiles * side, side)`."""
        return tokens_on_patches(on_tokens.reshape(-1, self.image_tokens), self.side).view(len(on_tokens), -1, self.side)

    def explanation(self, scores: dict[str, torch.Tensor], inputs: TileGridTokens, **fields: Any) -> VisionLanguageExplanation:
        """The text scores (0 at the image's placeholders) and the image's maps from each tile's patches: the pixels'
        relevance summed per patch (attnlrp, cp_lrp, input_x_gradient), the tower's patch tokens' scores
        (generic_attention, transformer_attribution), the occluded patches' (token_ablation) or the decoder's scores at
        the image's tokens laid back on their patches (the decoder-only methods and TAM, `through_tower` False); the
        grid's tiles side by side in `image_scores`, the thumbnail's in `base_scores`."""
        described = self.describe_inputs(inputs)
        text, image = scores["text"], described["image_tokens"].to(scores["text"].device)
        pixels, through = None, True
        if "image" in scores:
            patches = scores["image"]
        elif "leaves" in fields:
            pixels = self.pixel_relevance(fields.pop("leaves")["image"], inputs)
            patches = pixel_patches(pixels, self.patch)
        else:
            patches, through = self.image_token_map(text[image].view(len(text), -1), inputs), False
        grid, thumbnail = self.laid(patches, inputs)
        return VisionLanguageExplanation(scores=text.masked_fill(image, 0), **described, **fields, through_tower=through, image_scores=grid,
                                         base_scores=thumbnail, pixel_scores=pixels, image_size=inputs.image_size)

    def laid(self, patches: torch.Tensor, inputs: TileGridTokens) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(the grid's tiles side by side (N, rows * side, cols * side), the thumbnail's map (N, side, side) or None
        for one tile)` from per-tile patch maps, `(N, tiles, side, side)` or the tiles' grids one under the other."""
        per_tile = patches.reshape(len(patches), -1, self.side, self.side)
        rows, cols = inputs.grid
        return tiles_on_grid(per_tile[:, :rows * cols], rows, cols), per_tile[:, -1] if per_tile.shape[1] > 1 else None

    def seen_pixels(self, inputs: TileGridTokens) -> torch.Tensor:
        """The first row's image `(C, H, W)` as the grid's map lies on it: its grid's tiles side by side (the
        processor's normalised pixels; the thumbnail left out)."""
        rows, cols = inputs.grid
        return tiles_on_grid(inputs.pixel_values[0, :rows * cols].transpose(0, 1), rows, cols)

    def generation_explanation(self, fields: dict[str, Any], ids: torch.Tensor, images: dict[str, torch.Tensor],
                               picture: torch.Tensor | None, inputs: TileGridTokens) -> VisionLanguageGenerationExplanation:
        """A generation's result with both maps per generated token, from every tile's pixels' relevance
        (`images["image"]`, summed per patch) or TAM's patch maps (`images["patches"]`): `image_scores` the grid's
        tiles side by side, `base_scores` the thumbnail's (None for one tile)."""
        from ...results.viz import picture_url  # matplotlib, loaded when a page is drawn

        grid, thumbnail = self.laid(images["patches"] if "patches" in images else pixel_patches(images["image"], self.patch), inputs)
        return VisionLanguageGenerationExplanation(**fields, image_scores=grid, base_scores=thumbnail, image_tokens=(ids == self.image_token).cpu(),
                                                   image_url=None if picture is None else picture_url(picture))
