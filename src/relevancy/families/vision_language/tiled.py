"""LLaVA-NeXT and LLaVA-OneVision (`LlavaNextForConditionalGeneration`, `LlavaOnevisionForConditionalGeneration`),
unmodified: "anyres" images, each split by the processor into tiles of the tower's size at the best of
`image_grid_pinpoints` after a base tile (the image downscaled to one tile), every tile through the tower (CLIP;
OneVision's SigLIP) and LLaVA's projector, the tiles' features laid on one grid, unpadded to the image's aspect
(OneVision's interpolated down past its "anyres_max_k"), a learned `image_newline` embedding after each of its rows;
the base tile's features first.

Inputs are the processor's output (`input_ids` with the image's placeholders, `pixel_values` `(B, tiles, C, H, W)`,
`image_sizes`; one image per row, one image size per call). The model runs its own forward with the token embeddings
and the tiles' pixels as leaves (the tower's and projector's rules those of LLaVA's layout); which tile's patch each
image token is, or that it is a newline, the model's own `pack_image_features` says: the decoder-only methods'
scores at the image's tokens go back through its adjoint (`image_token_map`, autograd of the packing, a linear map). The maps: the base tile's on the tower's patch grid (`base_scores`), the other tiles'
laid on the grid the model lays their features on, unpadded as it unpads them (`image_scores`, the image's aspect;
`heatmap()` at the image's size; OneVision's before its interpolation); per tile per pixel (`pixel_scores` `(B, tiles, H, W)`, the pixel methods). The
newline tokens are the model's parameter, not the image: the decoder-only methods' scores at them are left out of
every map (the text scores hold 0 at all the image's placeholders), and the pixel methods' relevance reaching them
stays on the parameter, outside `relevance_total`. TAM filters the base tile's token grid and the tiles' (the newlines
left out of it, of its normalisation and of its causal inference) apart, as the authors' code filters several images.

`explain_generation` decodes with transformers' `generate` on the tiles and `image_sizes` (`decoding_inputs`); each
generated token gets both maps, `image_scores` and `base_scores`; the picture is the tiles laid on the grid and
unpadded as the model lays their features (`seen_pixels`), what `image_scores` lies on.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .adapter import VisionLanguageAdapter
from .batch import TiledImageTextTokens
from .explanation import VisionLanguageExplanation, VisionLanguageGenerationExplanation
from .layouts import TILED_LAYOUTS, is_vision_language, layout_named, pixel_patches, tiles_on_grid

#: what a LLaVA-NeXT processor's output may hold (batch_num_images: LLaVA-OneVision's images per row, 1 each, which
#: the model's forward then reads as it reads none)
TILED_PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images")


class TiledVisionLanguageAdapter(VisionLanguageAdapter):
    family = "tiled vision-language decoder (LLaVA-NeXT, LLaVA-OneVision)"
    #: attnlrp, cp_lrp, input_x_gradient reach every tile's pixels through tower and projector, token_ablation occludes
    #: every tile's patches; raw_attention, rollout, attention_gradcam read the decoder's attention only, the image's
    #: tokens laid back on the tiles' patches, and token_activation_map its logits at every position, filtered on the
    #: base tile's token grid and the tiles' apart (the tower-token methods are refused by name); generations with
    #: those of one forward (`methods_generating`)
    methods = ("raw_attention", "rollout", "attention_gradcam", "token_ablation", "attnlrp", "cp_lrp", "input_x_gradient",
               "token_activation_map")
    generates = True
    layouts = TILED_LAYOUTS
    examples = "transformers " + ", ".join(name for layout in layouts for name in layout.classes)

    def __init__(self, model: nn.Module) -> None:
        self.mapped(model)
        vision = model.config.vision_config
        self.patch, self.tile = int(vision.patch_size), int(vision.image_size)
        self.side = self.tile // self.patch  # each tile's patch grid is side x side
        self.tower_prefix = self.vision.tower_prefix(model)
        self.image_prefix = 0  # the model lays each tile's tokens on its patch grid: no [CLS] kept
        #: transformers' modeling module of the model (its `image_size_to_num_patches`, `get_anyres_image_grid_shape`, `unpad_image`)
        self.modeling = sys.modules[type(model.model).__module__]

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return is_vision_language(model) and layout_named(model) in cls.layouts

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> TiledImageTextTokens:
        """A `TiledImageTextTokens` on the model's device from the processor's output; a one-line error for anything but
        one image per row, every row's of one size (one call per size otherwise), its tiles and its placeholders in
        every row, before the processor's or the model's own error."""
        text, pixels, sizes = self.sized_output(inputs, "image_sizes", 2, TILED_PROCESSOR_KEYS, "", "sizes")
        images = inputs.get("batch_num_images")
        if images is not None and torch.as_tensor(images).tolist() != [1] * len(text):
            raise ValueError(f"batch_num_images must be 1 for every row (one image per row); got {torch.as_tensor(images).tolist()}")
        size = tuple(sizes[0].tolist())
        tiles = self.modeling.image_size_to_num_patches(size, self.model.config.image_grid_pinpoints, self.tile)
        shape = (len(text), tiles, 3, self.tile, self.tile)
        if tuple(pixels.shape) != shape:
            raise ValueError(f"pixel_values must be the processor's tiles (B, tiles, 3, H, W) = {shape} for an image of size "
                             f"{list(size)}; got {tuple(pixels.shape)}")
        count = len(self.packed(torch.zeros(tiles, self.side ** 2, 1, dtype=torch.float64, device=torch.device("cpu")), size))
        placeholders = (text.input_ids == self.image_token).sum(1)
        if (placeholders != count).any():
            raise ValueError(f"input_ids must hold one image's {count} placeholder tokens (id {self.image_token}) in every row for "
                             f"an image of size {list(size)}; counted per row: {placeholders.tolist()}: make the inputs with the "
                             "model's processor, processor(images=image, text=prompt)")
        device, dtype = text.input_ids.device, next(self.model.parameters()).dtype
        return TiledImageTextTokens(**{name: getattr(text, name) for name in ("input_ids", "attention_mask", "tokens", "word_ids")},
                                    pixel_values=pixels.to(device, dtype), image_sizes=sizes.to(device))

    def packed(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """The model's own `pack_image_features` of one image's per-tile features `(tiles, side * side, C)` (of `size`):
        `(image tokens, C)`, the base tile's tokens, then the tiles' grid row by row (unpadded; OneVision's
        interpolated), each row closed by a newline, which is 0 here."""
        settings = {name: getattr(self.model.config, name) for name in self.vision.pack_settings}
        packed, _ = self.model.model.pack_image_features([features], torch.tensor([size], device=features.device),
                                                         image_newline=features.new_zeros(features.shape[-1]), **settings)
        return packed[0]

    def image_token_map(self, on_tokens: torch.Tensor, inputs: TiledImageTextTokens) -> torch.Tensor:
        """Scores of the image's tokens `(B, image tokens)` laid back on the tiles' patches `(B, tiles, side, side)`
        through the adjoint of the packing (autograd of `packed`, a linear map): each token's score on the patch it is
        made of (OneVision's interpolated tokens: on their patches in the interpolation's weights), the newlines'
        dropped."""
        rows, tiles = len(on_tokens), inputs.pixel_values.shape[1]
        with torch.enable_grad():
            features = on_tokens.new_zeros(tiles, self.side ** 2, rows, requires_grad=True)
            laid, = torch.autograd.grad((self.packed(features, inputs.image_size) * on_tokens.T).sum(), features)
        return laid.permute(2, 0, 1).reshape(rows, tiles, self.side, self.side)

    # -- running ----------------------------------------------------------------------------------------------
    def patch_grid(self, inputs: TiledImageTextTokens) -> tuple[int, int]:
        """Token ablation's units: every tile's patches, the tiles' grids one under the other `(tiles * side, side)`."""
        return inputs.pixel_values.shape[1] * self.side, self.side

    def pixel_relevance(self, relevance: torch.Tensor, inputs: TiledImageTextTokens) -> torch.Tensor:
        """Each tile's pixels' relevance `(R, tiles, H, W)`, summed over the colour channels."""
        return relevance.sum(-3)

    def explanation(self, scores: dict[str, torch.Tensor], inputs: TiledImageTextTokens, **fields: Any) -> VisionLanguageExplanation:
        """The text scores (0 at the image's placeholders) and the image's maps (module docstring) from the tiles'
        patches: the pixels' relevance summed per patch (attnlrp, cp_lrp, input_x_gradient), the occluded patches'
        (token_ablation), or the decoder's scores at the image's tokens laid back on the patches they are made of
        (the attention methods, `through_tower` False; the newlines' left out)."""
        described = self.describe_inputs(inputs)
        text, image = scores["text"], described["image_tokens"].to(scores["text"].device)
        pixels, through = None, True
        if "image" in scores:
            patches = scores["image"].view(len(text), -1, self.side, self.side)
        elif "leaves" in fields:
            pixels = self.pixel_relevance(fields.pop("leaves")["image"], inputs)
            patches = pixel_patches(pixels, self.patch)
        else:
            patches, through = self.image_token_map(text[image].view(len(text), -1), inputs), False
        return VisionLanguageExplanation(scores=text.masked_fill(image, 0), **described, **fields, through_tower=through,
                                         image_scores=self.tiles_grid(patches[:, 1:], inputs), base_scores=patches[:, 0],
                                         pixel_scores=pixels, image_size=inputs.image_size)

    def image_token_grids(self, inputs: TiledImageTextTokens) -> tuple[tuple[torch.Tensor, tuple[int, int]], ...]:
        """TAM's two grids among the image's placeholders: the base tile's `side x side` tokens, then the tiles' grid
        as the model packs it (unpadded; OneVision's interpolated), its rows' newlines left out: a packing of ones
        (`packed`) is 0 at the newlines alone."""
        tiles, device = inputs.pixel_values.shape[1], inputs.input_ids.device
        laid = self.packed(torch.ones(tiles, self.side ** 2, 1, dtype=torch.float64, device=device), inputs.image_size)[:, 0]
        cells = (laid != 0).nonzero()[self.side ** 2:, 0]
        rows = int((laid == 0).sum())
        return (torch.arange(self.side ** 2, device=device), (self.side, self.side)), (cells, (rows, len(cells) // rows))

    def seen_pixels(self, inputs: TiledImageTextTokens) -> torch.Tensor:
        """The first row's image `(C, H, W)` in the processor's normalised pixels as the tiles' map lies on it: its
        tiles (the base tile left out) laid on the grid and unpadded as the model lays their patches (`tiles_grid`,
        each patch's pixels carried with it), the image at the tiles' resolution."""
        tiles = inputs.pixel_values[0, 1:]
        channels = tiles.shape[1]
        by_patch = tiles.unflatten(-1, (self.side, self.patch)).unflatten(-3, (self.side, self.patch))  # (tiles, C, side, P, side, P)
        laid = self.tiles_grid(by_patch.permute(1, 3, 5, 0, 2, 4).flatten(0, 2), inputs)  # (C * P * P, rows, cols)
        return laid.unflatten(0, (channels, self.patch, self.patch)).permute(0, 3, 1, 4, 2).flatten(3, 4).flatten(1, 2)

    def decoding_inputs(self, inputs: TiledImageTextTokens) -> dict[str, torch.Tensor]:
        """What the model's `generate` reads: the tiles `(B, tiles, C, H, W)` and `image_sizes`."""
        return {"pixel_values": inputs.pixel_values, "image_sizes": inputs.image_sizes}

    def generation_explanation(self, fields: dict[str, Any], ids: torch.Tensor, images: dict[str, torch.Tensor],
                               picture: torch.Tensor | None, inputs: TiledImageTextTokens) -> VisionLanguageGenerationExplanation:
        """A generation's result with both maps per generated token, from every tile's pixels' relevance
        (`images["image"]` `(G, tiles, H, W)`, summed per patch) or patch map (`images["patches"]` `(G, tiles, side,
        side)`, TAM's): `base_scores` the base tile's, `image_scores` the tiles' grid (`tiles_grid`)."""
        from ...results.viz import picture_url  # matplotlib, loaded when a page is drawn

        patches = images["patches"] if "patches" in images else pixel_patches(images["image"], self.patch)
        return VisionLanguageGenerationExplanation(**fields, image_scores=self.tiles_grid(patches[:, 1:], inputs), base_scores=patches[:, 0],
                                                   image_tokens=(ids == self.image_token).cpu(),
                                                   image_url=None if picture is None else picture_url(picture))

    def tiles_grid(self, patches: torch.Tensor, inputs: TiledImageTextTokens) -> torch.Tensor:
        """The tiles' patch maps `(B, tiles, side, side)` (the base tile left out; B any leading values per patch)
        laid on one grid as the model lays their features, row-major tiles, and unpadded as it unpads them
        (`unpad_image`): `(B, rows, cols)`."""
        size = inputs.image_size
        rows, cols = self.modeling.get_anyres_image_grid_shape(size, self.model.config.image_grid_pinpoints, self.tile)
        return self.modeling.unpad_image(tiles_on_grid(patches, rows, cols), size)
