"""Synthetic shapes benchmark: scenes with pixel-exact masks, a trained ViT and Swin and a trained CLIP (with captions).

>>> from relevancy.worlds import make_scenes, load_model, CLASSES
>>> scenes = make_scenes(8, seed=0, objects=2)
>>> model = load_model()          # shipped weights, eval mode, offline
>>> logits = model(scenes.images)
"""

from .scenes import (
    CLASSES,
    IMAGE_SIZE,
    MEAN,
    PATCH_SIZE,
    STD,
    Scenes,
    make_scenes,
    normalize,
    render_object,
)
from .shapes_vit import (
    EVAL_SEED_BASE,
    MODEL_CONFIG,
    WEIGHTS_PATH,
    build_model,
    evaluate_accuracy,
    load_model,
    pretrained_cfg,
)
from .shapes_swin import load_swin
from .captions import Tokenizer
from .shapes_clip import evaluate_clip, load_clip

__all__ = [
    "CLASSES",
    "IMAGE_SIZE",
    "PATCH_SIZE",
    "MEAN",
    "STD",
    "Scenes",
    "make_scenes",
    "normalize",
    "render_object",
    "EVAL_SEED_BASE",
    "MODEL_CONFIG",
    "WEIGHTS_PATH",
    "build_model",
    "evaluate_accuracy",
    "load_model",
    "pretrained_cfg",
    "load_swin",
    "Tokenizer",
    "evaluate_clip",
    "load_clip",
]
