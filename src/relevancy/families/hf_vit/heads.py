"""What the Hugging Face vision family knows of each model class's head, shared by the adapter and its rule map."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

#: transformers class name -> how its head reads the final hidden states (see `HFViTAdapter.head`)
HEADS = {
    "ViTModel": "features",
    "ViTForImageClassification": "class_token",
    "DeiTModel": "features",
    "DeiTForImageClassification": "class_token",
    "DeiTForImageClassificationWithTeacher": "teacher",
    "Dinov2Model": "features",
    "Dinov2ForImageClassification": "class_and_patches",
    "Dinov2WithRegistersModel": "features",
    "Dinov2WithRegistersForImageClassification": "class_and_patches",
}


def supported_class(model: nn.Module) -> type | None:
    """The transformers class of `HEADS` that `model` is (or derives from), None for anything else."""
    return next(
        (cls for cls in type(model).__mro__ if cls.__name__ in HEADS and cls.__module__.startswith("transformers.")), None
    )


@dataclass(frozen=True)
class HeadOps:
    """The head's operations that relevance rules treat specially: a relevance session swaps these for rule-aware
    ones (`rules.head_ops`); otherwise they are the plain tensor operations below."""

    class_token: Callable[[torch.Tensor], torch.Tensor]  # (B, T, D) -> (B, D), token 0
    mean_tokens: Callable[[torch.Tensor], torch.Tensor]  # (B, N, D) -> (B, D)
    average: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (a + b) / 2


PLAIN_OPS = HeadOps(class_token=lambda h: h[:, 0], mean_tokens=lambda t: t.mean(1), average=lambda a, b: (a + b) / 2)
