"""One forward pass that records what the methods read: attention probabilities and the last block's input."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .families.base import Adapter, forward_hooks
from .targets import Target, resolve_target, target_score


@dataclass
class Forward:
    """A recorded forward pass: outputs, recorded tensors, and the resolved target with its score."""

    logits: torch.Tensor
    pre_logits: torch.Tensor
    indices: torch.Tensor  # (B,) explained class per image, -1 for a concept
    score: torch.Tensor  # (B,) the explained score, differentiable when recorded with gradients
    attentions: list[torch.Tensor] = field(default_factory=list)  # per block (B, heads, T, T)
    last_attention_input: torch.Tensor | None = None  # (B, T, D), CDAM's X

    def gradients(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """d score / d tensor for each tensor; images in a batch do not mix, so one backward serves all."""
        return list(torch.autograd.grad(self.score.sum(), tensors))


def record_forward(
    adapter: Adapter,
    inputs: torch.Tensor,
    target: Target,
    *,
    attentions: bool = False,
    last_attention_input: bool = False,
    gradients: bool = False,
) -> Forward:
    """Run the model once, recording the asked-for tensors (the adapter's `explaining` context must be active)."""
    recorded: dict[str, list] = {"attentions": [], "last": []}
    modules = adapter.attention_probability_modules() if attentions else []
    last = [adapter.last_attention_input_module()] if last_attention_input else []
    with forward_hooks(modules, lambda _k, out: recorded["attentions"].append(out)), forward_hooks(
        last, lambda _k, out: recorded["last"].append(out)
    ), torch.set_grad_enabled(gradients):
        if gradients and not inputs.requires_grad:  # a graph even when the user froze every weight
            inputs = inputs.detach().requires_grad_(True)
        logits, pre_logits = adapter.forward(inputs)
        indices = resolve_target(target, logits)
        score = target_score(target, indices, logits, pre_logits)
    return Forward(
        logits=logits.detach(),
        pre_logits=pre_logits.detach(),
        indices=indices,
        score=score,
        attentions=recorded["attentions"],
        last_attention_input=recorded["last"][0] if recorded["last"] else None,
    )
