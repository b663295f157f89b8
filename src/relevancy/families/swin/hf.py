"""transformers' `SwinForImageClassification` and `Swinv2ForImageClassification`: the Swin family
(`adapter.WindowedAdapter`) where transformers keeps its pieces.

What differs from timm's: the stages are `swin.encoder.layers`, each ending with its patch merging (timm's begin with
it; the 2 x 2 concatenation order is the same); a layer whose grid is no larger than its window runs unshifted (the
model's own `set_shift_and_window_size`); the attention returns `(output, probabilities)` once the configs are
switched to relevancy's exact eager attention for the call (`hf_attention.explaining_call`); the embedding's
LayerNorm (and absolute position embedding, where the config has one) come before the first stage; the head is
`layernorm`, `AdaptiveAvgPool1d` over the tokens and the classifier.

V2 (`HFSwinv2Adapter`) differs from V1 in a few places only: each layer's window and shift are fixed when the model
is built; the self-attention returns its probabilities only when asked (`output_attentions`), so they are read where
it passes them through its dropout module, as for timm; the post-norm layer's attention reads the layer's input;
and it has its own rule map.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable
from .._shared import OutputPart, config_class_names, eval_mode
from ..hf_attention import TransformersImageCalls, attention_probabilities
from ..base import EmbeddingLeaf
from ..regions import InputPart
from .adapter import WindowedAdapter


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class HFSwinAdapter(TransformersImageCalls, WindowedAdapter):
    family = "Hugging Face Swin V1"
    examples = "SwinForImageClassification"
    model_class = "SwinForImageClassification"  # the transformers class `supports` takes (with its pooler)

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        try:
            import transformers
        except ImportError:  # transformers is optional
            return False
        return isinstance(model, getattr(transformers, cls.model_class)) and model.base_model.pooler is not None

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.backbone = model.base_model  # `swin` (V1) or `swinv2` (V2)
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
        """The patch tokens `(B, N, C)` after the embedding's LayerNorm, as timm's patch embedding returns them (before
        it the LayerNorm's scale invariance would leave input x gradient about 0)."""
        return {"image": EmbeddingLeaf(self.backbone.embeddings.norm)}

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


class HFSwinv2Adapter(HFSwinAdapter):
    """transformers' `Swinv2ForImageClassification`: V1's adapter, except where V2 differs (see the module's doc)."""

    family = "Hugging Face Swin V2"
    examples = "Swinv2ForImageClassification"
    model_class = "Swinv2ForImageClassification"

    def window_and_shift(self, block: nn.Module, grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
        """The layer's window and shift, fixed when the model was built (from the config's image size)."""
        window, shift = int(block.window_size), int(block.shift_size)
        return (window, window), (shift, shift)

    def attention_sites(self) -> list[AttentionSite]:
        # the self-attention's dropout returns the probabilities (the identity in eval mode), as timm's attn_drop
        return [AttentionSite("image", "image", block.attention.self.dropout) for block in self.blocks]

    def attention_inputs(self) -> dict[str, Hookable]:
        """The post-norm layer attends to its input (the `hidden_states` the last layer starts with)."""
        return {"image": InputPart(self.blocks[-1], 0, "hidden_states")}

    def relevance_rule_map(self) -> dict:
        from .hf_rules import rule_map_v2

        return rule_map_v2(self)

    def explaining(self, attention_probabilities: bool) -> AbstractContextManager[None]:
        """Eval mode only: the probabilities come from the model's own attention, no implementation is switched."""
        return eval_mode(self.model)

    def shared_state(self) -> list[object]:
        return []  # no config is switched
