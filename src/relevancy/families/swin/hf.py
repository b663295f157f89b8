"""transformers' `SwinForImageClassification`: the Swin family (`adapter.WindowedAdapter`) where transformers keeps
its pieces.

What differs from timm's: the stages are `swin.encoder.layers`, each ending with its patch merging (timm's begin with
it; the 2 x 2 concatenation order is the same); a layer whose grid is no larger than its window runs unshifted (the
model's own `set_shift_and_window_size`); the attention returns `(output, probabilities)` once the configs are
switched to relevancy's exact eager attention for the call (`hf_attention.explaining_call`); the embedding's
LayerNorm (and absolute position embedding, where the config has one) come before the first stage; the head is
`layernorm`, `AdaptiveAvgPool1d` over the tokens and the classifier.
"""
from __future__ import annotations


import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable
from .._shared import OutputPart, config_class_names
from ..hf_attention import TransformersImageCalls, attention_probabilities
from ..base import EmbeddingLeaf
from .adapter import WindowedAdapter


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class HFSwinAdapter(TransformersImageCalls, WindowedAdapter):
    family = "Hugging Face Swin"
    examples = "SwinForImageClassification"

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        try:
            from transformers import SwinForImageClassification
        except ImportError:  # transformers is optional
            return False
        return isinstance(model, SwinForImageClassification) and model.swin.pooler is not None

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.backbone = model.swin
        self.stage_modules = list(self.backbone.encoder.layers)
        self.blocks = [block for stage in self.stage_modules for block in stage.blocks]
        self.patch_size = _pair(self.backbone.embeddings.patch_embeddings.patch_size)

    def stages(self) -> list[tuple[bool, list[nn.Module]]]:
        return [(index > 0 and self.stage_modules[index - 1].downsample is not None, list(stage.blocks))
                for index, stage in enumerate(self.stage_modules)]

    def window_and_shift(self, block: nn.Module, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The layer's window; its shift, but none where the grid is no larger than the window (as the model's
        `set_shift_and_window_size` does before each run)."""
        window = int(block.window_size)
        shift = 0 if min(grid) <= window else int(block.shift_size)
        return (window, window), (shift, shift)

    def attention_sites(self) -> list[AttentionSite]:
        # the attention returns (output, probabilities): the probabilities are the tensor that multiplies the values
        return [AttentionSite("image", "image", OutputPart(block.attention, attention_probabilities)) for block in self.blocks]

    def attention_inputs(self) -> dict[str, Hookable]:
        return {"image": self.blocks[-1].layernorm_before}

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """The patch embedding's tokens `(B, N, C)` (the first item of what it returns)."""
        return {"image": EmbeddingLeaf(self.backbone.embeddings.patch_embeddings)}

    def relevance_rule_map(self) -> dict:
        from .hf_rules import rule_map

        return rule_map(self)

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """Channels from the config; sides multiples of the patch size (the model would pad them), its own size where
        it adds absolute position embeddings; the stages' grids (`check_grids`)."""
        config = self.model.config
        _, channels, height, width = shape
        (ph, pw), size = self.patch_size, _pair(config.image_size)
        if self.backbone.embeddings.position_embeddings is not None:
            fits, takes = (height, width) == size, f"(B, {config.num_channels}, {size[0]}, {size[1]}) (its absolute position embeddings' size)"
        else:
            fits = height >= ph and width >= pw and height % ph == 0 and width % pw == 0
            takes = f"(B, {config.num_channels}, H, W) with H a multiple of {ph} and W a multiple of {pw} (its patch size)"
        if not fits or channels != config.num_channels:
            raise ValueError(f"this model takes images of shape {takes}, got {shape}")
        self.check_grids(shape)

    def class_names(self) -> list[str] | None:
        return config_class_names(self.model.config)

    def embed(self, inputs: torch.Tensor, graph: bool = False) -> dict[str, torch.Tensor]:
        if graph and torch.is_grad_enabled() and not inputs.requires_grad:  # a graph even when every weight is frozen
            inputs = inputs.detach().requires_grad_(True)
        return {"image": self.backbone.embeddings(inputs)[0]}  # (B, h * w, C) in raster order

    def forward_tokens(
        self, inputs: torch.Tensor, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        backbone = self.backbone
        hidden = backbone.encoder(self.on_grid(inputs, tokens["image"], positions), self.grid_size(inputs)).last_hidden_state
        pooled = backbone.pooler(backbone.layernorm(hidden).transpose(1, 2)).flatten(1)
        return self.model.classifier(pooled), pooled
