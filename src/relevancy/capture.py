"""One forward pass that records what the methods read: attention probabilities and the last attentions' inputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .families.base import Adapter, forward_hooks
from .streams import AttentionSite
from .targets import Target, resolve_target, target_score


@dataclass
class Forward:
    """A recorded forward pass: outputs, recorded tensors, and the resolved target with its score."""

    logits: torch.Tensor
    pre_logits: torch.Tensor
    indices: torch.Tensor  # (B,) explained class per input, -1 for a concept or a callable target
    score: torch.Tensor  # (B,) the explained score, differentiable when recorded with gradients
    sites: list[AttentionSite] = field(default_factory=list)
    attentions: list[torch.Tensor] = field(default_factory=list)  # per site (B, heads, T_query, T_key)
    attention_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per stream (B, T, D), CDAM's X

    def self_attentions(self, stream: str) -> list[torch.Tensor]:
        """The recorded self-attentions of `stream`, block by block."""
        return [a for site, a in zip(self.sites, self.attentions) if site.is_self and site.query == stream]

    def gradients(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """d score / d tensor for each tensor; inputs of a batch do not mix, so one backward serves all. A tensor
        the score does not depend on (LXMERT's last image-to-text attention) gets zeros."""
        grads = torch.autograd.grad(self.score.sum(), tensors, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


def record_forward(
    adapter: Adapter,
    inputs: Any,
    target: Target,
    *,
    attentions: bool = False,
    attention_inputs: bool = False,
    gradients: bool = False,
) -> Forward:
    """Run the model once, recording the asked-for tensors (the adapter's `explaining` context must be active)."""
    sites = adapter.attention_sites() if attentions else []
    recorded: list[torch.Tensor] = [None] * len(sites)  # type: ignore[list-item]
    entering = adapter.attention_inputs() if attention_inputs else {}
    seen: dict[str, torch.Tensor] = {}
    names = list(entering)

    def keep_attention(k: int, out: torch.Tensor) -> None:
        recorded[k] = out

    def keep_input(k: int, out: torch.Tensor) -> None:
        seen[names[k]] = out

    with forward_hooks([s.probabilities for s in sites], keep_attention), forward_hooks(
        list(entering.values()), keep_input
    ), torch.set_grad_enabled(gradients):
        logits, pre_logits = adapter.forward(inputs, graph=gradients)
        indices = resolve_target(target, logits)
        score = target_score(target, indices, logits, pre_logits)
    return Forward(
        logits=logits.detach(),
        pre_logits=pre_logits.detach(),
        indices=indices,
        score=score,
        sites=sites,
        attentions=recorded,
        attention_inputs=seen,
    )
