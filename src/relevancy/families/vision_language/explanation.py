"""A vision-language decoder's explanations: the prompt's text tokens and the image for one explained token, and
for every token of a generation."""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from ...results.explanation import PAGE_SUFFIXES, PICTURE_SUFFIXES, DecoderExplanation, GenerationExplanation, save_overlays
from ...results.parts import ImagePart, TextPart


@dataclass
class VisionLanguageExplanation(DecoderExplanation):
    """Relevance of each prompt token (`scores` `(B, T)`: 0 at the image's placeholder tokens, whose relevance is the
    image's) and of the image (`image_scores` `(B, rows, cols)` on the vision tower's patch grid: each patch's pixels
    summed; `pixel_scores` `(B, H, W)`: per pixel, summed over the colour channels) for the explained token.
    `relevance_total`: the share of the explained score reaching text and image together; `image_share` `(B,)`:
    the image's share of the absolute relevance. `heatmap()`: the patch scores upsampled to the image's pixels.
    `through_tower`: True where the image's relevance was carried through the vision tower: to the pixels (attnlrp,
    cp_lrp, input_x_gradient), to the tower's patch tokens (generic_attention) or by occluding its patches
    (token_ablation; these two give no `pixel_scores`); False for the decoder-only attention methods (raw_attention,
    rollout, attention_gradcam), whose image map is the decoder's scores at the image's tokens laid back on the patch
    grid through the projector's token layout, without passing through the tower (no `pixel_scores` then).
    LLaVA-NeXT and OneVision (tiled images, `tiled.py`): `image_scores` the tiles' map on the grid the model lays
    their features on, unpadded to the image's aspect; `base_scores` `(B, side, side)` the base tile's (the image downscaled to one
    tile) on the tower's patch grid; `pixel_scores` `(B, tiles, H, W)` per tile, the base tile first. InternVL with
    several tiles (`internvl.py`): `image_scores` the grid's tiles side by side as the picture holds them,
    `base_scores` the thumbnail's, `pixel_scores` `(B, tiles, H, W)` per tile in the processor's order, the thumbnail
    last."""

    image_scores: torch.Tensor | None = None
    base_scores: torch.Tensor | None = None
    pixel_scores: torch.Tensor | None = field(default=None, repr=False)
    image_tokens: torch.Tensor | None = field(default=None, repr=False)  # (B, T) bool: the image's placeholder tokens
    image_size: tuple[int, int] | None = None  # (H, W) of the images
    through_tower: bool = True

    part_fields: ClassVar[dict[str, str]] = {"text": "scores", "image": "image_scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES + PAGE_SUFFIXES

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        return {**super().parts, "image": ImagePart(self.image_scores, self.signed, tuple(self.image_size or self.pixel_scores.shape[-2:]))}

    def heatmap(self) -> torch.Tensor:
        """`(B, H, W)`: the patch scores upsampled bilinearly to the image's pixels (raw values)."""
        return self.parts["image"].heatmap()

    @property
    def image_share(self) -> torch.Tensor:
        """`(B,)`: the image's share of the absolute relevance of pixels (or, where it was not carried through the
        tower, of the image's patches) and text tokens together."""
        image = (self.image_scores if self.pixel_scores is None else self.pixel_scores).abs().flatten(1).sum(1)
        return image / (image + self.scores.abs().sum(1))

    def picture(self, path: Path, images: torch.Tensor | None) -> Path:
        """The image part as an overlay PNG, one panel per row, over `images` where given: the rows' pictures
        `(B, 3, H, W)` in [0, 1] (the call's inputs hold the processor's normalised `pixel_values`, and the result
        does not know the processor's mean and std: undo them first, `pixel_values * std + mean`)."""
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.labels()])


@dataclass
class VisionLanguageGenerationExplanation(GenerationExplanation):
    """What a vision-language decoder looked at to write each token of a generation
    (`relevancy.explain_generation(model, processor, prompt, image=...)`): `scores` `(G, T + G)` over the text
    tokens as for decoders (0 at the image's placeholder tokens, whose relevance is the image's), `image_scores`
    `(G, rows, cols)`: row `g` the relevance of each patch of the tower's grid (Qwen2-VL: the image's own) for
    generated token `g` (each patch's pixels summed); `image_tokens` `(T + G,)` marks the placeholders; `image_url`: the image as the model saw
    it (the processor's pixels, back in [0, 1]) as a PNG data URL, under the maps of the page and of `.png`.
    `relevance_total` (LRP methods): the share of each logit reaching text and pixels together.
    LLaVA-NeXT and OneVision: `image_scores` the tiles' map on the grid the model lays their features on, unpadded,
    `base_scores` `(G, side, side)` the base tile's, `image_url` the tiles laid on that grid (the page draws the
    tiles' map). InternVL with several tiles: `image_scores` the grid's tiles side by side, `base_scores` the
    thumbnail's, `image_url` the grid's tiles side by side."""

    image_scores: torch.Tensor | None = None
    base_scores: torch.Tensor | None = None
    image_tokens: torch.Tensor | None = field(default=None, repr=False)
    image_url: str | None = field(default=None, repr=False)

    part_fields: ClassVar[dict[str, str]] = {"text": "scores", "image": "image_scores"}
    suffixes: ClassVar[tuple[str, ...]] = PICTURE_SUFFIXES + PAGE_SUFFIXES

    @property
    def parts(self) -> dict[str, ImagePart | TextPart]:
        """The text part (a row per generated token) and the image part on the patch grid, at the picture's size."""
        size = tuple(self.pictures().shape[-2:]) if self.image_url else tuple(self.image_scores.shape[-2:])
        return {**super().parts, "image": ImagePart(self.image_scores, self.signed, size)}

    def pictures(self) -> torch.Tensor:
        """`(G, 3, H, W)` in [0, 1]: the picture (`image_url`) once per generated token."""
        import numpy as np
        from PIL import Image

        encoded = self.image_url.split(",", 1)[1]
        array = np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB"), dtype=np.float32) / 255
        return torch.from_numpy(array).permute(2, 0, 1)[None].expand(len(self.generated_ids), -1, -1, -1)

    def heatmap(self) -> torch.Tensor:
        """`(G, H, W)`: each generated token's patch scores upsampled bilinearly to the picture's pixels (raw)."""
        return self.parts["image"].heatmap()

    def picture(self, path: Path, images: torch.Tensor | None) -> Path:
        """An overlay PNG, a panel per generated token, over the picture (or `images` `(G, 3, H, W)` in [0, 1])."""
        if images is None and self.image_url:
            images = self.pictures()
        return save_overlays(self.parts["image"], path, images, [f"{self.method}: {c}" for c in self.labels()])
