"""What is explained: a class per input, the predicted class, or a concept given by examples."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn


class Concept:
    """A CDAM concept: the mean pre-logits latent of examples; explained as `f(x) = z(x) . c`.

    `Concept(model, examples)` takes what `explain` takes for that model (an image batch `(N, C, H, W)`, or a
    text model's tokenizer output), runs the model on the examples in batches of `batch_size` and leaves the
    model as it was.
    """

    def __init__(self, model: nn.Module, examples: object, batch_size: int = 64) -> None:
        from .adapters import adapter_for

        adapter = adapter_for(model)
        inputs = adapter.check_inputs(examples)
        if len(inputs) == 0:
            raise ValueError("a Concept needs at least one example")
        with adapter.explaining(attention_probabilities=False), torch.no_grad():
            latents = [adapter.forward(chunk)[1] for chunk in adapter.batches(inputs, batch_size)]
        self.vector = torch.cat(latents).mean(0)

    @classmethod
    def from_vector(cls, vector: torch.Tensor) -> "Concept":
        """A concept from a latent vector computed elsewhere (e.g. saved from an earlier run)."""
        concept = cls.__new__(cls)
        concept.vector = vector
        return concept

    def score(self, pre_logits: torch.Tensor) -> torch.Tensor:
        return pre_logits @ self.vector.to(pre_logits)

    def __repr__(self) -> str:
        return f"Concept(dim={self.vector.numel()})"


Target = Union[None, int, Sequence[int], torch.Tensor, Concept]


def resolve_target(target: Target, logits: torch.Tensor) -> torch.Tensor:
    """One class index per image (`(B,)` long); predicted classes for None; -1 for a concept."""
    batch, num_classes = logits.shape
    if isinstance(target, Concept):
        return torch.full((batch,), -1, dtype=torch.long, device=logits.device)
    if target is None:
        return logits.argmax(-1)
    indices = torch.as_tensor(target, dtype=torch.long, device=logits.device).flatten()
    if indices.numel() == 1:
        indices = indices.expand(batch)
    if indices.numel() != batch:
        raise ValueError(f"target has {indices.numel()} entries for a batch of {batch} images; give one per image or one for all")
    bad = indices[(indices < 0) | (indices >= num_classes)]
    if bad.numel():
        raise ValueError(f"target {bad[0].item()} is out of range: the model has {num_classes} classes (valid: 0..{num_classes - 1})")
    return indices.clone()


def target_score(target: Target, indices: torch.Tensor, logits: torch.Tensor, pre_logits: torch.Tensor) -> torch.Tensor:
    """The explained score per image, `(B,)`: the target logit, or the concept score."""
    if isinstance(target, Concept):
        return target.score(pre_logits)
    return logits.gather(1, indices[:, None]).squeeze(1)
