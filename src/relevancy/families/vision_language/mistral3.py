"""Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2), unmodified: a Pixtral tower (RMSNorms, a
gated MLP, 2-D RoPE over the patches' rows and columns, images of any size given by `image_sizes`, the images of a
call in one sequence under a block-diagonal mask), its projector (an RMSNorm, the patch merger: k x k neighbouring
patches unfolded side by side into one Linear, then LLaVA's MLP) and a Mistral decoder; what differs from the other
layouts is `layouts.MISTRAL3`'s. Pixtral-12B (`LlavaForConditionalGeneration` with a `PixtralVisionModel` tower) is
the same tower before LLaVA's projector, no merger (k = 1): `layouts.PIXTRAL`.

Inputs are the processor's output (`input_ids` with the image's `[IMG]` placeholders, one per merged token, the
processor's `[IMG_BREAK]` after each row of them and `[IMG_END]` after the last, which are text tokens;
`pixel_values` `(B, 3, H, W)`, `image_sizes` `(B, 2)`): one image per row, all of one size per call. The model runs
its own forward with the token embeddings and the pixels as leaves; under AttnLRP and CP-LRP the tower runs the
layout's rule forwards and relevancy's attention, switched through the vision config as the decoder's is, the 2-D
rotation of its queries and keys a constant (its gradient passes relevance coordinate by coordinate). The maps: the
pixels' relevance summed over the channels (`pixel_scores`) and per patch on the image's own patch grid
(`image_scores`); the decoder-only methods' scores at the image's tokens shared by each token's k x k patches.
"""
from __future__ import annotations

import torch
from torch import nn

from .adapter import MergedGridAdapter
from .batch import SizedImageTextTokens
from ..base import UnsupportedModelError
from .layouts import MISTRAL3, PIXTRAL_LAYOUTS, is_vision_language, layout_named

#: what a Mistral 3 (Pixtral) processor's output may hold
MISTRAL3_PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_sizes")


class Mistral3VisionLanguageAdapter(MergedGridAdapter):
    family = "Mistral 3 / Pixtral vision-language decoder"
    #: attnlrp, cp_lrp, input_x_gradient reach the pixels through tower and projector, token_ablation occludes the
    #: image's patches; raw_attention, rollout, attention_gradcam read the decoder's attention only and
    #: token_activation_map its logits at every position, the image's tokens laid back on the patch grid (the
    #: tower-token methods are refused by name); generations with those of one forward (`methods_generating`)
    methods = ("raw_attention", "rollout", "attention_gradcam", "token_ablation", "attnlrp", "cp_lrp", "input_x_gradient",
               "token_activation_map")
    generates = True
    layouts = PIXTRAL_LAYOUTS
    examples = "transformers " + ", ".join(MISTRAL3.classes) + ", LlavaForConditionalGeneration with a PixtralVisionModel tower (Pixtral-12B)"

    def __init__(self, model: nn.Module) -> None:
        self.mapped(model)  # the Pixtral tower and projector, the Mistral decoder
        strategy = getattr(model.config, "vision_feature_select_strategy", "full")  # LLaVA's (Pixtral-12B's "full")
        if strategy != "full":
            raise UnsupportedModelError(f"cannot map {type(model).__name__} with a Pixtral tower and vision_feature_select_strategy "
                                        f"{strategy!r}: the tower has no [CLS] to crop; relevancy maps 'full' (Pixtral-12B's)")
        self.patch = int(model.config.vision_config.patch_size)
        self.merge = int(getattr(model.config, "spatial_merge_size", 1))  # LLaVA's projector merges none
        self.image_prefix = 0  # every image token is a cell of the merged grid

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return is_vision_language(model) and layout_named(model) in cls.layouts

    def check_inputs(self, inputs: object) -> SizedImageTextTokens:
        """A `SizedImageTextTokens` on the model's device from the processor's output; a one-line error for anything
        but one image per row, every row's of one size (one call per size otherwise) of whole merged patches, the
        pixels of that size, its `(H / (P k)) * (W / (P k))` placeholders in every row, before the model's own error."""
        text, pixels, sizes = self.sized_output(inputs, "image_sizes", 2, MISTRAL3_PROCESSOR_KEYS, "", "sizes")
        height, width = sizes[0].tolist()
        step = self.patch * self.merge
        if height % step or width % step:
            raise ValueError(f"image_sizes {[height, width]} is not a grid of whole merged patches ({step} x {step} pixels): make the "
                             "inputs with the model's processor")
        shape = (len(text), 3, height, width)
        if tuple(pixels.shape) != shape:
            raise ValueError(f"pixel_values must be (B, 3, H, W) = {shape}: one image per row of its image_sizes; got {tuple(pixels.shape)}")
        count = (height // step) * (width // step)
        placeholders = (text.input_ids == self.image_token).sum(1)
        if (placeholders != count).any():
            raise ValueError(f"input_ids must hold one image's {count} placeholder tokens (id {self.image_token}) in every row; counted "
                             f"per row: {placeholders.tolist()}: make the inputs with the model's processor, one image per row")
        device, dtype = text.input_ids.device, next(self.model.parameters()).dtype
        return SizedImageTextTokens(**{name: getattr(text, name) for name in ("input_ids", "attention_mask", "tokens", "word_ids")},
                                    pixel_values=pixels.to(device, dtype), image_sizes=sizes.to(device))

    def patch_grid(self, inputs: SizedImageTextTokens) -> tuple[int, int]:
        """The image's own patch grid `(H / P, W / P)` (one size per batch, `check_inputs`)."""
        height, width = inputs.image_size
        return height // self.patch, width // self.patch

    def decoding_inputs(self, inputs: SizedImageTextTokens) -> dict[str, torch.Tensor]:
        """What the model's `generate` reads besides the token ids and their mask: the pixels and `image_sizes`."""
        return {"pixel_values": inputs.pixel_values, "image_sizes": inputs.image_sizes}
