"""Tiny timm models (random init) of every layout the ViT adapter supports."""
from __future__ import annotations

import timm
import torch

TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)


def tiny_vit(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, **{**TINY, **overrides}).eval()


def tiny_deit_distilled() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, patch_size=8, **TINY).eval()


def tiny_registers() -> torch.nn.Module:
    """DINOv2 layout: register tokens, layer scale, patch 14, dynamic image size."""
    torch.manual_seed(0)
    return timm.create_model(
        "vit_small_patch14_reg4_dinov2", pretrained=False, img_size=42, **TINY, dynamic_img_size=True
    ).eval()


def tiny_global_pool() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, class_token=False, global_pool="avg", **TINY).eval()


def tiny_swin(seed: int = 0) -> torch.nn.Module:
    """Two stages (8 x 8 then 4 x 4 tokens), windows of 2 x 2, shifted in every second block; random weights with a
    random relative position bias, float64, eval mode."""
    torch.manual_seed(seed)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4, embed_dim=8,
                              depths=(2, 2), num_heads=(2, 2), window_size=2, num_classes=5, drop_path_rate=0.0)
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                block.attn.relative_position_bias_table.normal_(0, 0.5)
    return model.double().eval()
