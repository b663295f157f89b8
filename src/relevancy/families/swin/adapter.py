"""timm's `SwinTransformer` family: windowed and shifted-window attention over a grid of tokens that patch merging
halves stage by stage, read through global average pooling.

One stream `image` whose grid is the first stage's patch grid. Each block is one self-attention site; its
probabilities are `(B * windows, heads, w, w)`, laid out on the stage's tokens by the stream's `TokenLayout`
(which token each window place holds, the shift's roll undone), and each patch merging joins 2 x 2 tokens. The
model has no [CLS]: the readout-row methods read the pooled token's row (`Stream.pooled`), the mean of the last
stage's rows, carried down through the merges to the patch grid.
"""
from __future__ import annotations

from typing import ContextManager

import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable, Stream, TokenLayout
from ..base import IMAGE_ENCODER_METHODS, EmbeddingLeaf, ImageAdapter
from ..timm_common import check_timm_image_shape, fused_attention_off, timm_class_names, timm_input_fields


def _is_timm_swin(model: nn.Module) -> bool:
    try:
        from timm.models.swin_transformer import SwinTransformer
        from timm.models.swin_transformer_v2 import SwinTransformerV2
    except ImportError:  # timm is a dependency, but a user may have removed it
        return False
    return isinstance(model, (SwinTransformer, SwinTransformerV2))


def windows_of(height: int, width: int, window: tuple[int, int], shift: tuple[int, int], device: torch.device) -> torch.Tensor:
    """`(n, w)`: the raster index, on an `height x width` grid, of the token at each place of each window once the grid
    is rolled by `-shift` (the shifted windows) and cut into `window`-sized windows in raster order, as timm does."""
    rolled = torch.arange(height * width, device=device).view(height, width).roll((-shift[0], -shift[1]), (0, 1))
    cut = rolled.view(height // window[0], window[0], width // window[1], window[1])
    return cut.permute(0, 2, 1, 3).reshape(-1, window[0] * window[1])


def merged_groups(height: int, width: int, device: torch.device) -> torch.Tensor:
    """`(height * width / 4, 4)`: the raster index, on an `height x width` grid, of the 2 x 2 tokens each token of the
    halved grid is made of (patch merging)."""
    grid = torch.arange(height * width, device=device).view(height // 2, 2, width // 2, 2)
    return grid.permute(0, 2, 1, 3).reshape(-1, 4)


class WindowedAdapter(ImageAdapter):
    """What every Swin adapter shares (timm's, transformers'): one pooled stream `image` on the first stage's patch
    grid, its `TokenLayout` from the blocks' windows and shifts and the stages' merges, the checks that no window or
    merge is padded, the patch tokens set back on the grid for token ablation. A library's adapter says where its
    stages, blocks and patch size are (`stages`, `window_and_shift`, `patch_size`) and how it runs."""

    methods = IMAGE_ENCODER_METHODS
    patch_size: tuple[int, int]

    def stages(self) -> list[tuple[bool, list[nn.Module]]]:
        """Per stage: whether a patch merging comes before its blocks, and its blocks."""
        raise NotImplementedError

    def window_and_shift(self, block: nn.Module, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The window and the shift `block` runs with on a `grid` of tokens."""
        raise NotImplementedError

    def grid_size(self, inputs: torch.Tensor) -> tuple[int, int]:
        return inputs.shape[-2] // self.patch_size[0], inputs.shape[-1] // self.patch_size[1]

    def steps(self, grid: tuple[int, int], shape: tuple[int, ...]) -> list[tuple[bool, tuple[int, int], tuple[int, int], tuple[int, int]]]:
        """Per block: whether a merge comes right before it, its grid, window and shift; images of `shape` whose
        stages would pad a merge or a window are refused (a padded window or merge would attend to, or merge,
        tokens that are not the image's)."""
        steps = []
        height, width = grid
        for index, (merged, blocks) in enumerate(self.stages()):
            if merged:
                if height % 2 or width % 2:
                    raise ValueError(f"stage {index} merges 2 x 2 tokens of a {height} x {width} grid: images of shape "
                                     f"{shape} would be padded; take sides whose patch grids halve evenly at every stage")
                height, width = height // 2, width // 2
            for block in blocks:
                window, shift = self.window_and_shift(block, (height, width))
                if height % window[0] or width % window[1]:
                    raise ValueError(f"stage {index}'s {height} x {width} grid is not a multiple of its {window[0]} x "
                                     f"{window[1]} windows for images of shape {shape}: padded windows are not explained")
                steps.append((merged, (height, width), window, shift))
                merged = False
        return steps

    def layout(self, grid: tuple[int, int], device: torch.device) -> TokenLayout:
        """Per block its windows and, for a stage's first block after a patch merging, the merged groups."""
        windows, merges, before = [], [], grid
        for merged, (height, width), window, shift in self.steps(grid, ()):
            merges.append(merged_groups(*before, device) if merged else None)
            windows.append(windows_of(height, width, window, shift, device))
            before = (height, width)
        return TokenLayout(tuple(windows), tuple(merges))

    def streams(self, inputs: torch.Tensor) -> dict[str, Stream]:
        grid = self.grid_size(inputs)
        return {"image": Stream("image", "image", 0, None, grid=grid, pooled=True, layout=self.layout(grid, inputs.device))}

    def check_grids(self, shape: tuple[int, ...]) -> None:
        """Every stage's grid even where it is merged and a multiple of its blocks' windows (`steps`)."""
        self.steps((shape[-2] // self.patch_size[0], shape[-1] // self.patch_size[1]), shape)

    def on_grid(self, inputs: torch.Tensor, tokens: torch.Tensor, positions: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The patch tokens `(B, N, C)`; a selection of them (token ablation) has every token it lacks set to 0 on the
        grid: the windows and merges need every place of it."""
        if positions is None or "image" not in positions:
            return tokens
        height, width = self.grid_size(inputs)
        placed = tokens.new_zeros(len(tokens), height * width, tokens.shape[-1])
        placed[torch.arange(len(tokens), device=tokens.device)[:, None], positions["image"]] = tokens
        return placed


class SwinAdapter(WindowedAdapter):
    family = "timm SwinTransformer (V1, V2)"
    examples = "swin_*_patch4_window*, swinv2_*_window*, with global average pooling"

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        if not _is_timm_swin(model):
            return False
        pool = getattr(getattr(model, "head", None), "global_pool", None)
        return getattr(pool, "pool_type", "") == "avg" and all(
            hasattr(b, "attn") and hasattr(b.attn, "attn_drop") and hasattr(b, "shift_size") for b in _blocks(model))

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.blocks = _blocks(model)
        self.patch_size = tuple(model.patch_embed.patch_size)

    def stages(self) -> list[tuple[bool, list[nn.Module]]]:
        return [(not isinstance(stage.downsample, nn.Identity), list(stage.blocks)) for stage in self.model.layers]

    def window_and_shift(self, block: nn.Module, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        return tuple(block.window_size), tuple(block.shift_size)

    def attention_sites(self) -> list[AttentionSite]:
        # timm applies attn_drop to the window softmax; in eval mode it is the identity, so its output is A per window
        return [AttentionSite("image", "image", b.attn.attn_drop) for b in self.blocks]

    def attention_inputs(self) -> dict[str, Hookable]:
        """The tokens entering the last attention: V1's block normalises them first (`norm1`); V2's post-norm block
        attends to its input, the output of the module before it."""
        from timm.models.swin_transformer_v2 import SwinTransformerV2Block

        if not isinstance(self.blocks[-1], SwinTransformerV2Block):
            return {"image": self.blocks[-1].norm1}
        stage = self.model.layers[-1]
        return {"image": stage.blocks[-2] if len(stage.blocks) > 1 else stage.downsample}

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """The patch embedding's tokens `(B, h, w, C)`."""
        return {"image": EmbeddingLeaf(self.model.patch_embed)}

    def relevance_rule_map(self) -> dict:
        from .rules import rule_map

        return rule_map()

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """timm's sizes, and the stages' grids (`check_grids`)."""
        check_timm_image_shape(self.model, shape)
        self.check_grids(shape)

    def class_names(self) -> list[str] | None:
        return timm_class_names(self.model)

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        return timm_input_fields(self.model, inputs)

    def explaining(self, attention_probabilities: bool) -> ContextManager[None]:
        """Eval mode; V1's fused attention kernel off where the probabilities are needed (V2's cosine attention has
        none)."""
        fused = [b.attn for b in self.blocks if hasattr(b.attn, "fused_attn")]
        return fused_attention_off(self.model, fused, attention_probabilities)

    def embed(self, inputs: torch.Tensor, graph: bool = False) -> dict[str, torch.Tensor]:
        if graph and torch.is_grad_enabled() and not inputs.requires_grad:  # a graph even when every weight is frozen
            inputs = inputs.detach().requires_grad_(True)
        return {"image": self.model.patch_embed(inputs).flatten(1, 2)}  # (B, h * w, C) in raster order

    def forward_tokens(
        self, inputs: torch.Tensor, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        height, width = self.grid_size(inputs)
        x = self.on_grid(inputs, tokens["image"], positions)
        features = m.norm(m.layers(x.reshape(len(x), height, width, -1)))
        return m.forward_head(features), m.forward_head(features, pre_logits=True)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Every `SwinTransformerBlock`, stage by stage."""
    return [block for stage in model.layers for block in stage.blocks]
