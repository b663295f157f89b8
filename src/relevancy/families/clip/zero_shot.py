"""A CLIP model plus class prompts as an image classifier, so every image method explains "why class k" on it."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...core.guard import exclusive
from .._shared import eval_mode
from .batch import text_ids
from .towers import towers_of


class ZeroShotClassifier(nn.Module):
    """`logits[b, k] = exp(logit_scale) * cos(image b, prompt k)`: CLIP's zero-shot classifier as a module.

    `prompts`: the tokenizer's output (or `input_ids`) for one prompt per class ("a photo of a {class}"), encoded
    once here; `class_names` label the classes in explanations. The CLIP model is used as it is (not copied).
    """

    def __init__(self, clip: nn.Module, prompts: object, class_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.clip = clip
        towers = towers_of(clip)
        ids, mask = text_ids(prompts)
        device = next(clip.parameters()).device
        with exclusive(clip, *towers._shared_state()), torch.inference_mode(False), torch.no_grad():
            with eval_mode(clip):
                features = towers.text_features(ids.to(device), None if mask is None else mask.to(device))
        self.register_buffer("class_features", F.normalize(features, dim=-1), persistent=False)
        if class_names is not None and len(class_names) != len(ids):
            raise ValueError(f"{len(class_names)} class names for {len(ids)} prompts: give one name per prompt")
        self.class_names = list(class_names) if class_names is not None else None

    @property
    def num_classes(self) -> int:
        return len(self.class_features)

    def logits_from_features(self, image_features: torch.Tensor) -> torch.Tensor:
        """`(B, K)` from unnormalised image features `(B, E)`."""
        scale = self.clip.logit_scale.exp()
        return scale * F.normalize(image_features, dim=-1) @ self.class_features.to(image_features).T

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits_from_features(towers_of(self.clip).image_features(images))
