"""Methods that weight attention or tokens by gradients of the explained score."""
from __future__ import annotations

import torch

from ..adapters.base import Adapter
from ..capture import record_forward
from ..targets import Target
from .attention import class_token_row


def attention_gradcam(adapter: Adapter, inputs: torch.Tensor, target: Target, normalize: bool = False) -> tuple[torch.Tensor, ...]:
    """Grad-CAM on the last attention: heads weighted by their mean [CLS]-row gradient, then ReLU.

    `normalize=True` min-max normalises each map, as the authors' baseline code does.
    """
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True)
    attention = fwd.attentions[-1]
    (grad,) = fwd.gradients([attention])
    p = adapter.num_prefix_tokens
    cam = attention[:, :, 0, p:].detach()
    weights = grad[:, :, 0, p:].mean(-1, keepdim=True)
    scores = (weights * cam).mean(1).clamp(min=0)
    if normalize:
        low, high = scores.amin(-1, keepdim=True), scores.amax(-1, keepdim=True)
        scores = (scores - low) / (high - low)
    return scores, fwd.indices, fwd.logits


def generic_attention(adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0) -> tuple[torch.Tensor, ...]:
    """Chefer et al. ICCV'21 self-attention rule: `R += E_h (G * A)^+ @ R` from `start_layer` on."""
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True)
    if not 0 <= start_layer < len(fwd.attentions):
        raise ValueError(f"start_layer must be in 0..{len(fwd.attentions) - 1}, got {start_layer}")
    used = fwd.attentions[start_layer:]
    grads = fwd.gradients(used)
    tokens = used[0].shape[-1]
    relevance = torch.eye(tokens, dtype=used[0].dtype, device=used[0].device).expand(len(inputs), tokens, tokens)
    for attention, grad in zip(used, grads):
        relevance = relevance + (grad * attention.detach()).clamp(min=0).mean(1) @ relevance
    return class_token_row(relevance, adapter.num_prefix_tokens), fwd.indices, fwd.logits


def cdam(adapter: Adapter, inputs: torch.Tensor, target: Target) -> tuple[torch.Tensor, ...]:
    """Brocki & Chung: `sum_d X * dF/dX` at the normalised tokens entering the last attention; signed."""
    fwd = record_forward(adapter, inputs, target, last_attention_input=True, gradients=True)
    tokens = fwd.last_attention_input
    (grad,) = fwd.gradients([tokens])
    scores = (tokens.detach() * grad).sum(-1)
    return scores[:, adapter.num_prefix_tokens:], fwd.indices, fwd.logits
