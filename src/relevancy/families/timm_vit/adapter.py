"""timm's `VisionTransformer` family: ViT, DeiT (distilled too), DINO/DINOv2 (register tokens, layer scale)."""
from __future__ import annotations

from typing import ContextManager

import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable, Stream
from ..base import IMAGE_ENCODER_METHODS, EmbeddingLeaf, ImageAdapter
from ..timm_common import check_timm_image_shape, fused_attention_off, timm_class_names, timm_input_fields


def _is_timm_vit(model: nn.Module) -> bool:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # timm is a dependency, but a user may have removed it
        return False
    return isinstance(model, VisionTransformer)


class TimmViTAdapter(ImageAdapter):
    family = "timm VisionTransformer"
    methods = IMAGE_ENCODER_METHODS
    examples = "vit_*, deit_*, deit_*_distilled_*, vit_*_dinov2, vit_*_reg*, any image size"

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        if not _is_timm_vit(model):
            return False
        return all(
            hasattr(b, "attn") and hasattr(b, "norm1") and hasattr(b.attn, "attn_drop") and hasattr(b.attn, "fused_attn")
            for b in model.blocks
        )

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.blocks = list(model.blocks)
        self.num_prefix_tokens = int(model.num_prefix_tokens)
        self.has_class_token = model.cls_token is not None and getattr(model, "global_pool", "token") == "token"

    def streams(self, inputs: torch.Tensor) -> dict[str, Stream]:
        readout = torch.zeros(len(inputs), dtype=torch.long, device=inputs.device) if self.has_class_token else None
        return {"image": Stream("image", "image", self.num_prefix_tokens, readout, grid=self.grid_size(inputs))}

    def attention_sites(self) -> list[AttentionSite]:
        # timm applies attn_drop to the softmax output; in eval mode it is the identity, so its output is A.
        return [AttentionSite("image", "image", b.attn.attn_drop) for b in self.blocks]

    def attention_inputs(self) -> dict[str, Hookable]:
        return {"image": self.blocks[-1].norm1}

    def relevance_rule_map(self) -> dict:
        from .rules import rule_map

        return rule_map()

    def embedding_leaves(self) -> dict[str, EmbeddingLeaf]:
        """The patch embedding's tokens (`(B, N, D)`, or `(B, h, w, D)` with a dynamic size)."""
        return {"image": EmbeddingLeaf(self.model.patch_embed)}

    def grid_size(self, inputs: torch.Tensor) -> tuple[int, int]:
        patch_embed = self.model.patch_embed
        if getattr(self.model, "dynamic_img_size", False) or getattr(patch_embed, "dynamic_img_pad", False):
            return tuple(patch_embed.dynamic_feat_size(tuple(inputs.shape[-2:])))
        return tuple(patch_embed.grid_size)

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        check_timm_image_shape(self.model, shape)

    def class_names(self) -> list[str] | None:
        return timm_class_names(self.model)

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        return timm_input_fields(self.model, inputs)

    def explaining(self, attention_probabilities: bool) -> ContextManager[None]:
        return fused_attention_off(self.model, [b.attn for b in self.blocks], attention_probabilities)

    def embed(self, inputs: torch.Tensor, graph: bool = False) -> dict[str, torch.Tensor]:
        m = self.model
        if graph and torch.is_grad_enabled() and not inputs.requires_grad:  # a graph even when every weight is frozen
            inputs = inputs.detach().requires_grad_(True)
        return {"image": m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(inputs))))}

    def forward_tokens(
        self, inputs: torch.Tensor, tokens: dict[str, torch.Tensor], rows: torch.Tensor | None = None,
        positions: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        features = m.norm(m.blocks(tokens["image"]))
        return m.forward_head(features), m.forward_head(features, pre_logits=True)
