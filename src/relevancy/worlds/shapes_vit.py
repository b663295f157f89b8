"""The benchmark classifier: a small timm VisionTransformer for the shapes world."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .scenes import CLASSES, IMAGE_SIZE, MEAN, PATCH_SIZE, STD, make_scenes

__all__ = [
    "MODEL_CONFIG",
    "WEIGHTS_PATH",
    "build_model",
    "load_model",
    "evaluate_accuracy",
    "pretrained_cfg",
]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_PATH = WEIGHTS_DIR / "shapes_vit.safetensors"

#: keyword arguments of :class:`timm.models.vision_transformer.VisionTransformer`
MODEL_CONFIG = dict(
    img_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    in_chans=3,
    num_classes=len(CLASSES),
    global_pool="token",
    class_token=True,
    embed_dim=96,
    depth=6,
    num_heads=3,
    mlp_ratio=4.0,
    qkv_bias=True,
)

#: first seed of the evaluation streams; training uses seeds below this
EVAL_SEED_BASE = 10**9


def pretrained_cfg() -> dict:
    """timm-style pretrained config (data config + class names)."""
    return dict(
        architecture="vit_shapes_64",
        input_size=(3, IMAGE_SIZE, IMAGE_SIZE),
        fixed_input_size=True,
        interpolation="bilinear",
        crop_pct=1.0,
        crop_mode="center",
        mean=tuple(MEAN),
        std=tuple(STD),
        num_classes=len(CLASSES),
        label_names=tuple(CLASSES),
        first_conv="patch_embed.proj",
        classifier="head",
    )


def build_model(**overrides) -> torch.nn.Module:
    """Untrained model with the benchmark architecture (timm ``VisionTransformer``)."""
    from timm.models.vision_transformer import VisionTransformer

    cfg = dict(MODEL_CONFIG)
    cfg.update(overrides)
    return described(VisionTransformer(**cfg), cfg["num_classes"])


def described(model: torch.nn.Module, num_classes: int, **fields) -> torch.nn.Module:
    """`model` with the shapes world's timm pretrained config (`pretrained_cfg()`, its class count and `fields` set)
    and class names: what timm's data config and the apps read of a shapes classifier."""
    pc = dict(pretrained_cfg(), num_classes=num_classes, **fields)
    model.pretrained_cfg = pc
    model.default_cfg = pc
    model.class_names = tuple(CLASSES)
    return model


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The shipped, trained shapes ViT in eval mode (offline).

    ``model.class_names`` and ``model.pretrained_cfg["label_names"]`` hold
    :data:`CLASSES`; ``timm.data.resolve_data_config({}, model=model)`` gives
    the input size and normalisation.
    """
    from safetensors.torch import load_file
    from safetensors import safe_open

    path = Path(path) if path is not None else WEIGHTS_PATH
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path}; run `python -m training.shapes_vit`")
    overrides = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "model_config" in meta:
        overrides = json.loads(meta["model_config"])
        if "mlp_ratio" in overrides:
            overrides["mlp_ratio"] = float(overrides["mlp_ratio"])
    model = build_model(**overrides)
    model.load_state_dict(load_file(str(path)))
    model.eval()
    return model.to(device)


@torch.no_grad()
def evaluate_accuracy(model: torch.nn.Module, n: int = 2000, seed: int = EVAL_SEED_BASE,
                      batch_size: int = 250) -> dict:
    """Accuracy on fresh scenes from evaluation seeds (never used in training).

    Returns ``{"single_top1": ..., "pair_top2": ..., "n": n}``: top-1 accuracy on
    ``n`` one-object scenes and, on ``n`` two-object scenes, the fraction where
    the two present classes are the two highest logits.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    single = make_scenes(n, seed=seed, objects=1)
    pair = make_scenes(n, seed=seed + 1, objects=2)
    correct1 = correct2 = 0
    for s in range(0, n, batch_size):
        logits = model(single.images[s:s + batch_size].to(device)).cpu()
        correct1 += (logits.argmax(1) == single.labels[s:s + batch_size, 0]).sum().item()
        logits = model(pair.images[s:s + batch_size].to(device)).cpu()
        top2 = logits.topk(2, dim=1).indices.sort(1).values
        lab = pair.labels[s:s + batch_size].sort(1).values
        correct2 += (top2 == lab).all(1).sum().item()
    model.train(was_training)
    return {"single_top1": correct1 / n, "pair_top2": correct2 / n, "n": n}
