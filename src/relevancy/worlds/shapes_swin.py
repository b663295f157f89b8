"""The benchmark's hierarchical classifier: a small timm SwinTransformer for the shapes world, beside the shapes ViT.

Patches of 4 px (a 16 x 16 grid), windows of 4 x 4 tokens shifted by 2 in every second block, two patch merges
(16 x 16, 8 x 8, 4 x 4 tokens), global average pooling: the layout of swin_tiny at a 64 px scale.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .scenes import CLASSES, IMAGE_SIZE
from .shapes_vit import WEIGHTS_DIR, described

__all__ = ["SWIN_CONFIG", "SWIN_WEIGHTS_PATH", "build_swin", "load_swin"]

SWIN_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_swin.safetensors"

#: keyword arguments of :class:`timm.models.swin_transformer.SwinTransformer`
SWIN_CONFIG = dict(
    img_size=IMAGE_SIZE,
    patch_size=4,
    in_chans=3,
    num_classes=len(CLASSES),
    window_size=4,
    embed_dim=48,
    depths=(2, 2, 2),
    num_heads=(3, 6, 12),
    mlp_ratio=4.0,
)


def build_swin(**overrides) -> torch.nn.Module:
    """Untrained model with the benchmark's Swin architecture, its timm pretrained config and class names set."""
    from timm.models.swin_transformer import SwinTransformer

    cfg = dict(SWIN_CONFIG)
    cfg.update(overrides)
    return described(SwinTransformer(**cfg), cfg["num_classes"], architecture="swin_shapes_64", classifier="head.fc")


def load_swin(path: str | Path | None = None, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The shipped, trained shapes Swin in eval mode (offline); its architecture read from the file's metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path) if path is not None else SWIN_WEIGHTS_PATH
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path}; run `python -m training.shapes_swin`")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    overrides = json.loads(meta["model_config"]) if "model_config" in meta else {}
    for key in ("depths", "num_heads"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    model = build_swin(**overrides)
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return model.to(device)
