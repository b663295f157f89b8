"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`,
`Qwen3VLForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`), unmodified: a tower of any image size (the
processor's flattened patches and `image_grid_thw`), its 2 x 2 patch merger (Qwen3-VL's DeepStack mergers beside it,
their features added to the decoder's first layers at the image's tokens), a Qwen2 or Qwen3 decoder with multimodal
RoPE (3-D positions from `get_rope_index`); what differs between them is their layout's (`layouts.QWEN_LAYOUTS`).

The model runs its own forward with the token embeddings and the flattened patches as leaves, the decoder's 3-D
positions computed by the model's own `get_rope_index` (passed in, so that the model's cached `rope_deltas` stay as
they were). Under AttnLRP and CP-LRP the tower runs the layout's rule forwards (norms with a constant divisor, the
identity rule on the MLPs' activations, the merger's norm and MLP alike) and relevancy's attention, switched through
the vision config as the decoder's is (the tower calls it once per image, or per window in Qwen2.5-VL's windowed
blocks: the `cu_seqlens` blocks, so no mask is needed); the rotations of the tower's and the decoder's queries and
keys are constants, whose gradient passes relevance coordinate by coordinate. The pixels' relevance is read in the
processor's order and laid back on each image's pixels (`patch_pixels`): Qwen2.5-VL's window reordering happens
inside the tower and is undone by the tower itself before the decoder, and the pixels never see it.

`explain_generation` decodes with transformers' `generate` on the processor's flattened patches, `image_grid_thw` and
`mm_token_type_ids` (`decoding_inputs`), which caches `rope_deltas` on the model: `explaining` puts them back after
every call. Its maps come from the same one forward as the other families' (the image's own patch grid), its picture
from the flattened patches (`seen_pixels`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .adapter import MergedGridAdapter
from .batch import GridImageTextTokens
from .layouts import QWEN_LAYOUTS, patch_pixels, patches_on_pixels

#: what a Qwen2-VL processor's output may hold (mm_token_type_ids: made again from the placeholder tokens)
QWEN_PROCESSOR_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


class QwenVisionLanguageAdapter(MergedGridAdapter):
    family = "Qwen-VL vision-language decoder"
    #: attnlrp, cp_lrp, input_x_gradient reach the pixels through tower and merger, token_ablation occludes the
    #: image's patches (`ablated`); raw_attention, rollout, attention_gradcam read the decoder's attention only and
    #: token_activation_map its logits at every position, the image's tokens laid back on the patch grid (the
    #: tower-token methods are refused by name); generations with those of one forward (`methods_generating`)
    methods = ("raw_attention", "rollout", "attention_gradcam", "token_ablation", "attnlrp", "cp_lrp", "input_x_gradient",
               "token_activation_map")
    generates = True
    layouts = QWEN_LAYOUTS
    examples = "transformers " + ", ".join(name for layout in layouts for name in layout.classes)

    def __init__(self, model: nn.Module) -> None:
        self.mapped(model)  # the tower and merger, the Qwen2 decoder
        vision = model.config.vision_config
        self.patch, self.merge = int(vision.patch_size), int(vision.spatial_merge_size)
        self.channels = int(vision.in_channels)
        self.patch_width = self.channels * int(vision.temporal_patch_size) * self.patch ** 2
        self.image_prefix = 0  # every image token is a cell of the merged grid

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        return type(model).__name__ in {name for layout in cls.layouts for name in layout.classes}

    # -- inputs ---------------------------------------------------------------------------------------------
    def check_inputs(self, inputs: object) -> GridImageTextTokens:
        """A `GridImageTextTokens` on the model's device from the processor's output, each row's patches apart; a
        one-line error for anything but one image per row, every image of one grid (one call per size otherwise),
        its `t * h * w / k^2` placeholders in every row, before the processor's or the model's own error."""
        text, pixels, grid = self.sized_output(inputs, "image_grid_thw", 3, QWEN_PROCESSOR_KEYS, " (images only: no videos)", "patch grids")
        frames, rows, cols = grid[0].tolist()
        if frames != 1 or rows % self.merge or cols % self.merge:
            raise ValueError(f"image_grid_thw {grid[0].tolist()} is not one image's grid (t = 1, h and w multiples of the merge "
                             f"size {self.merge}): relevancy explains images, not videos")
        count = rows * cols
        if tuple(pixels.shape) != (len(text) * count, self.patch_width):
            raise ValueError(f"pixel_values must be the processor's flattened patches (B * h * w, C * T * P * P) = "
                             f"{(len(text) * count, self.patch_width)} for image_grid_thw {grid[0].tolist()}; got {tuple(pixels.shape)}")
        placeholders = (text.input_ids == self.image_token).sum(1)
        if (placeholders != count // self.merge ** 2).any():
            raise ValueError(f"input_ids must hold one image's {count // self.merge ** 2} placeholder tokens (id {self.image_token}) "
                             f"in every row; counted per row: {placeholders.tolist()}: make the inputs with the model's processor "
                             "(processor.apply_chat_template with one image per row)")
        device, dtype = text.input_ids.device, next(self.model.parameters()).dtype
        return GridImageTextTokens(**{name: getattr(text, name) for name in ("input_ids", "attention_mask", "token_type_ids", "tokens", "word_ids")},
                                   pixel_values=pixels.to(device, dtype).view(len(text), count, -1), image_grid_thw=grid.to(device),
                                   patch=self.patch)

    # -- running ----------------------------------------------------------------------------------------------
    def hidden_of(self, inputs: GridImageTextTokens, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor,
                  source: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own forward over the token rows `ids` (`mask`) with the images `pixels` `(R, h * w, ...)`, row
        `r` of input row `source[r]`, at the 3-D positions of the model's `get_rope_index`: the decoder's last
        hidden states `(R, N, D)`. `types` (PaliGemma's prefix in the base adapter) is never given here: Qwen2-VL's
        layouts read no processor token types (`mm_token_type_ids` is made again from the placeholders)."""
        grid = inputs.image_grid_thw[source]
        inner = self.model.model
        positions, _ = inner.get_rope_index(input_ids=ids, mm_token_type_ids=(ids == self.image_token).int(), image_grid_thw=grid,
                                            attention_mask=mask)
        return inner(input_ids=ids, pixel_values=pixels.flatten(0, 1), image_grid_thw=grid, attention_mask=mask,
                     position_ids=positions, use_cache=False).last_hidden_state

    def patch_grid(self, inputs: GridImageTextTokens) -> tuple[int, int]:
        """The images' own patch grid `(h, w)` (one per batch, `check_inputs`)."""
        _, rows, cols = inputs.image_grid_thw[0].tolist()
        return rows, cols

    def without_patches(self, pixels: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
        """The rows' flattened patches `(R, h * w, ...)` with the patches `removed` `(R, h, w)` (bool, on the grid)
        set to 0, the processor's mean: the grid taken to the processor's order (merge groups consecutive)."""
        count, rows, cols = len(removed), removed.shape[1] // self.merge, removed.shape[2] // self.merge
        grouped = removed.view(count, rows, self.merge, cols, self.merge).permute(0, 1, 3, 2, 4).reshape(count, -1)
        return pixels * (~grouped)[..., None].to(pixels.dtype)

    def recomputed_layers(self) -> list[nn.Module]:
        """`checkpoint=True` runs the tower's blocks again in the backward too, not only the decoder's layers."""
        return [*self.vision.transformer(self.model).blocks, *self.blocks]

    def pixel_relevance(self, relevance: torch.Tensor, inputs: GridImageTextTokens) -> torch.Tensor:
        """The flattened patches' relevance `(R, h * w, C * T * P * P)` laid back on each image's pixels `(R, h * P,
        w * P)` (`patch_pixels`: the colour channels and temporal copies summed, the merge groups undone)."""
        return patch_pixels(relevance, self.patch_grid(inputs), self.channels, self.patch, self.merge)

    def seen_pixels(self, inputs: GridImageTextTokens) -> torch.Tensor:
        """The first row's image `(C, H, W)` in the processor's normalised pixels, its flattened patches (the first
        temporal copy: the processor repeats an image) laid back on the grid."""
        patches = inputs.pixel_values[0].unflatten(-1, (self.channels, -1, self.patch, self.patch))[:, :, 0]  # (h * w, C, P, P)
        return patches_on_pixels(patches.transpose(0, 1), self.patch_grid(inputs), self.merge)

    def decoding_inputs(self, inputs: GridImageTextTokens) -> dict[str, torch.Tensor]:
        """What the model's `generate` reads: the processor's flattened patches `(B * h * w, ...)`, `image_grid_thw`
        and `mm_token_type_ids` (1 at the image's placeholders, from which it computes its 3-D positions)."""
        return {"pixel_values": inputs.pixel_values.flatten(0, 1), "image_grid_thw": inputs.image_grid_thw,
                "mm_token_type_ids": (inputs.input_ids == self.image_token).int()}

    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        """The decoder's switches for the call, and the model's cached `rope_deltas` (which transformers' `generate`
        sets, `explain_generation`'s decoding) as they were after it, also after an exception."""
        cached = self.model.model.rope_deltas
        try:
            with super().explaining(attention_probabilities):
                yield
        finally:
            self.model.model.rope_deltas = cached
