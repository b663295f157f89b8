"""timm's `VisionTransformer` family: ViT, DeiT (distilled too), DINO/DINOv2 (register tokens, layer scale)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ...core.streams import AttentionSite, Hookable, Stream
from .._shared import eval_mode
from ..base import SEED_METHODS, ImageAdapter


def _is_timm_vit(model: nn.Module) -> bool:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # timm is a dependency, but a user may have removed it
        return False
    return isinstance(model, VisionTransformer)


class TimmViTAdapter(ImageAdapter):
    family = "timm VisionTransformer"
    methods = SEED_METHODS
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

    def grid_size(self, inputs: torch.Tensor) -> tuple[int, int]:
        patch_embed = self.model.patch_embed
        if getattr(self.model, "dynamic_img_size", False) or getattr(patch_embed, "dynamic_img_pad", False):
            return tuple(patch_embed.dynamic_feat_size(tuple(inputs.shape[-2:])))
        return tuple(patch_embed.grid_size)

    def check_image_shape(self, shape: tuple[int, ...]) -> None:
        """Channels from the patch embedding; size as timm takes it: the model's own image size, or with
        `dynamic_img_size` multiples of the patch size (any size with `dynamic_img_pad`)."""
        _, channels, height, width = shape
        patch_embed = self.model.patch_embed
        proj = getattr(patch_embed, "proj", None)
        # a hybrid embedding's projection reads CNN features, not the image: its channels are not checked
        expected_channels = proj.in_channels if isinstance(proj, nn.Conv2d) and not hasattr(patch_embed, "backbone") else None
        channel_text = "C" if expected_channels is None else str(expected_channels)
        size = getattr(patch_embed, "img_size", None)
        patch = tuple(getattr(patch_embed, "patch_size", (1, 1)))
        dynamic = getattr(self.model, "dynamic_img_size", False)
        if size is not None and (getattr(patch_embed, "strict_img_size", True) or not dynamic):
            fits = (height, width) == tuple(size)
            takes = f"(B, {channel_text}, {size[0]}, {size[1]})"
        elif getattr(patch_embed, "dynamic_img_pad", False):
            fits = True
            takes = f"(B, {channel_text}, H, W) of any size"
        else:
            fits = height >= patch[0] and width >= patch[1] and height % patch[0] == 0 and width % patch[1] == 0
            takes = f"(B, {channel_text}, H, W) with H a multiple of {patch[0]} and W a multiple of {patch[1]} (its patch size)"
        if fits and expected_channels in (None, channels):
            return
        raise ValueError(f"this model takes images of shape {takes}, got {shape}")

    def class_names(self) -> list[str] | None:
        config = getattr(self.model, "pretrained_cfg", None) or {}
        names = getattr(self.model, "class_names", None) or config.get("label_names")
        if names:
            return list(names)
        if not config:
            return None
        from timm.data import ImageNetInfo, infer_imagenet_subset

        subset = infer_imagenet_subset(self.model)
        if subset is None:
            return None
        info = ImageNetInfo(subset)
        return [info.index_to_description(i).split(",")[0] for i in range(self.model.num_classes)]

    def describe_inputs(self, inputs: torch.Tensor) -> dict:
        fields = {"input_size": tuple(inputs.shape[-2:])}
        if getattr(self.model, "pretrained_cfg", None):
            from timm.data import resolve_data_config

            config = resolve_data_config({}, model=self.model)
            fields.update(mean=tuple(config["mean"]), std=tuple(config["std"]))
        return fields

    @contextmanager
    def explaining(self, attention_probabilities: bool) -> Iterator[None]:
        attentions = [b.attn for b in self.blocks]
        fused = [a.fused_attn for a in attentions]
        with eval_mode(self.model):
            try:
                if attention_probabilities:
                    for a in attentions:
                        a.fused_attn = False
                yield
            finally:
                for a, flag in zip(attentions, fused):
                    a.fused_attn = flag

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
