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
