"""A small CLIP for the shapes world (Hugging Face ``transformers.CLIPModel``).

>>> from relevancy.worlds.shapes_clip import load_clip
>>> model, tokenizer = load_clip()            # shipped weights, eval mode, offline
>>> batch = tokenizer(["a photo of a star", "a red ring"])
>>> out = model(pixel_values=scenes.images, **batch)   # out.logits_per_image

Images are :class:`~relevancy.worlds.scenes.Scenes` ``images`` (64x64,
normalised with mean = std = 0.5); texts go through the word-level
:class:`~relevancy.worlds.captions.Tokenizer`.  The end token is the largest id
and is the config's ``eos_token_id``, so HF pools the text at the end token,
exactly where ``input_ids.argmax(-1)`` points.

Evaluation (:func:`evaluate_clip`) uses scene seeds ``EVAL_SEED_BASE`` (one
object) and ``EVAL_SEED_BASE + 1`` (two objects), the ViT's test seeds; all
training seeds are below ``EVAL_SEED_BASE = 10**9``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .captions import (COLORS, Caption, Tokenizer, attribute_arrays, caption_truth, object_phrase,
                       zero_shot_prompt)
from .shapes_vit import EVAL_SEED_BASE, WEIGHTS_DIR
from .scenes import CLASSES, IMAGE_SIZE, MEAN, PATCH_SIZE, STD, make_scenes

__all__ = [
    "CLIP_CONFIG",
    "CLIP_WEIGHTS_PATH",
    "CONTEXT_LENGTH",
    "build_clip",
    "load_clip",
    "encode_texts",
    "encode_images",
    "evaluate_clip",
]

CLIP_WEIGHTS_PATH = WEIGHTS_DIR / "shapes_clip.safetensors"
CLIP_CONFIG_PATH = WEIGHTS_DIR / "shapes_clip.json"
CONTEXT_LENGTH = 16

_TOKENIZER = Tokenizer()

#: keyword arguments of :class:`transformers.CLIPConfig`
CLIP_CONFIG = dict(
    text_config=dict(
        vocab_size=len(_TOKENIZER),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=CONTEXT_LENGTH,
        hidden_act="quick_gelu",
        pad_token_id=_TOKENIZER.pad_id,
        bos_token_id=_TOKENIZER.start_id,
        eos_token_id=_TOKENIZER.end_id,
        projection_dim=128,
    ),
    vision_config=dict(
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        num_channels=3,
        hidden_size=96,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        hidden_act="quick_gelu",
        projection_dim=128,
    ),
    projection_dim=128,
    logit_scale_init_value=2.6592,
)


def _config(cfg: dict):
    from transformers import CLIPConfig

    return CLIPConfig(**cfg)


def build_clip(config: dict | None = None):
    """Untrained ``transformers.CLIPModel`` with :data:`CLIP_CONFIG` (or ``config``)."""
    from transformers import CLIPModel

    return CLIPModel(_config(config or CLIP_CONFIG))


def load_clip(path: str | Path | None = None, device: str | torch.device = "cpu"):
    """The shipped shapes CLIP in eval mode and its tokenizer, ``(model, tokenizer)``.

    Reads ``shapes_clip.safetensors`` and, beside it, ``shapes_clip.json``
    (config and vocabulary); no network access.
    """
    from safetensors.torch import load_file

    path = Path(path) if path is not None else CLIP_WEIGHTS_PATH
    meta_path = path.with_suffix(".json")
    if not path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no weights/config at {path} / {meta_path}; "
                                "run `python -m training.shapes_clip`")
    meta = json.loads(meta_path.read_text())
    tokenizer = Tokenizer(tuple(meta["vocab"][1:-2]))
    if tuple(meta["vocab"]) != tokenizer.vocab:
        raise ValueError(f"{meta_path}: vocabulary must be <pad>, words, <start>, <end>")
    model = build_clip(meta["config"])
    model.load_state_dict(load_file(str(path)))
    model.eval()
    model.image_mean, model.image_std = MEAN, STD  # what explanations undo to show the scenes
    return model.to(device), tokenizer


def encode_texts(model, tokenizer: Tokenizer, texts: list[str], batch_size: int = 512) -> torch.Tensor:
    """L2-normalised text embeddings (len(texts), projection_dim), on the model's device."""
    device = next(model.parameters()).device
    out = []
    for s in range(0, len(texts), batch_size):
        enc = tokenizer(texts[s:s + batch_size], CONTEXT_LENGTH)
        out.append(_features(model.get_text_features(**{k: v.to(device) for k, v in enc.items()})))
    return torch.nn.functional.normalize(torch.cat(out), dim=-1)


def encode_images(model, images: torch.Tensor, batch_size: int = 250) -> torch.Tensor:
    """L2-normalised image embeddings (n, projection_dim), on the model's device."""
    device = next(model.parameters()).device
    out = [_features(model.get_image_features(pixel_values=images[s:s + batch_size].to(device)))
           for s in range(0, len(images), batch_size)]
    return torch.nn.functional.normalize(torch.cat(out), dim=-1)


def _features(out) -> torch.Tensor:
    # transformers 5 returns a model output from get_*_features; 4.x a tensor
    return out if isinstance(out, torch.Tensor) else out.pooler_output


@torch.no_grad()
def evaluate_clip(model, tokenizer: Tokenizer, n: int = 2000, seed: int = EVAL_SEED_BASE,
                  candidates: int = 100) -> dict:
    """The two targets on ``n`` fresh scenes of each kind (seeds ``seed``, ``seed + 1``).

    * ``zero_shot_top1``: one-object scenes classified by the most similar of
      the prompts "a photo of a {shape}" for the 12 shapes.
    * ``retrieval_at1``: for two-object scene ``i``, the caption "a {colour}
      {shape}" of one of its objects (object ``i % 2``) must score scene ``i``
      strictly above ``candidates - 1`` other two-object scenes, drawn at
      random (seeded) from those of which that caption is *not* true (no
      object with that shape and colour name), so the task is unambiguous
      (fewer when ``n`` is too small to offer that many).
    """
    was_training = model.training
    model.eval()
    single = make_scenes(n, seed=seed, objects=1)
    pair = make_scenes(n, seed=seed + 1, objects=2)
    prompts = encode_texts(model, tokenizer, [zero_shot_prompt(c) for c in CLASSES])
    img1 = encode_images(model, single.images)
    zs = ((img1 @ prompts.T).argmax(1).cpu() == single.labels[:, 0]).float().mean().item()

    att = attribute_arrays(pair)
    caps = []
    for i in range(n):
        j = i % 2
        shape, color = int(att["shape"][i, j]), int(att["color"][i, j])
        caps.append(Caption(object_phrase(CLASSES[shape], COLORS[color]), ((shape, color, -1, -1),)))
    truth = caption_truth(caps, [att])  # (scenes, captions)
    txt = encode_texts(model, tokenizer, [c.text for c in caps])
    img2 = encode_images(model, pair.images)
    sim = (img2 @ txt.T).cpu().numpy()  # (scenes, captions)
    rng = np.random.default_rng([seed, 7])
    hits = 0
    for i in range(n):
        neg = np.flatnonzero(~truth[:, i])
        pick = rng.choice(neg, size=min(candidates - 1, neg.size), replace=False)
        hits += bool(sim[i, i] > sim[pick, i].max())
    model.train(was_training)
    return {"zero_shot_top1": zs, "retrieval_at1": hits / n, "n": n,
            "seeds": [seed, seed + 1], "candidates": candidates}

