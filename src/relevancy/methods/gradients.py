"""Methods that weight attention or tokens by gradients of the explained score."""
from __future__ import annotations

import torch

from ..families.base import Adapter
from ..capture import record_forward
from ..targets import Target
from .attention import class_token_row, family_option, set_class_entry, token_mask


def attention_gradcam(
    adapter: Adapter, inputs: torch.Tensor, target: Target, normalize: bool = False, region: str | None = None,
    cls_entry: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Grad-CAM on the last attention: heads weighted by their mean gradient, then ReLU.

    `normalize=True` min-max normalises each map, as the authors' baseline code does; a constant map (the
    ReLU left nothing) becomes zeros where the reference divides 0 by 0.
    `region`: where the gradient is averaged and the min-max taken: "class_row" (the [CLS] row at the patch
    columns, the ViT reference) or "matrix" (the whole attention matrix over the real tokens, the BERT reference).
    `cls_entry`: see `set_class_entry`, applied after the normalisation (the BERT reference: "zero").
    """
    region = family_option(adapter, "attention_gradcam", "region", region, "class_row")
    if region not in ("class_row", "matrix"):
        raise ValueError(f"region must be 'class_row' or 'matrix', got {region!r}")
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True)
    attention = fwd.attentions[-1]
    (grad,) = fwd.gradients([attention])
    p = adapter.num_prefix_tokens
    if region == "class_row":
        cam = attention[:, :, 0, p:].detach()
        weights = grad[:, :, 0, p:].mean(-1, keepdim=True)
        scores = (weights * cam).mean(1).clamp(min=0)
        low, high = scores.amin(-1, keepdim=True), scores.amax(-1, keepdim=True)
    else:
        valid = token_mask(adapter, inputs)
        if valid is None:
            valid = torch.ones(attention.shape[0], attention.shape[-1], dtype=torch.bool, device=attention.device)
        pairs = (valid[:, :, None] & valid[:, None, :])[:, None]  # (B, 1, T, T)
        weights = (grad * pairs).sum((-2, -1), keepdim=True) / pairs.sum((-2, -1), keepdim=True)
        maps = (attention.detach() * weights).mean(1).clamp(min=0)  # (B, T, T)
        scores = maps[:, 0, p:]
        low = maps.masked_fill(~pairs[:, 0], float("inf")).amin((-2, -1))[:, None]
        high = maps.masked_fill(~pairs[:, 0], float("-inf")).amax((-2, -1))[:, None]
    if normalize:
        span = high - low
        scores = (scores - low) / torch.where(span > 0, span, torch.ones_like(span))
    how = family_option(adapter, "attention_gradcam", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), fwd.indices, fwd.logits


def generic_attention(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0, cls_entry: str | None = None
) -> tuple[torch.Tensor, ...]:
    """Chefer et al. ICCV'21 self-attention rule: `R += E_h (G * A)^+ @ R` from `start_layer` on.

    `cls_entry`: see `set_class_entry` (text models: "zero", as the BERT rollout reference; its value holds the identity).
    """
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True)
    if not 0 <= start_layer < len(fwd.attentions):
        raise ValueError(f"start_layer must be in 0..{len(fwd.attentions) - 1}, got {start_layer}")
    used = fwd.attentions[start_layer:]
    grads = fwd.gradients(used)
    tokens = used[0].shape[-1]
    relevance = torch.eye(tokens, dtype=used[0].dtype, device=used[0].device).expand(len(used[0]), tokens, tokens)
    for attention, grad in zip(used, grads):
        relevance = relevance + (grad * attention.detach()).clamp(min=0).mean(1) @ relevance
    scores = class_token_row(relevance, adapter.num_prefix_tokens)
    how = family_option(adapter, "generic_attention", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), fwd.indices, fwd.logits


def cdam(adapter: Adapter, inputs: torch.Tensor, target: Target) -> tuple[torch.Tensor, ...]:
    """Brocki & Chung: `sum_d X * dF/dX` at the normalised tokens entering the last attention; signed."""
    fwd = record_forward(adapter, inputs, target, last_attention_input=True, gradients=True)
    tokens = fwd.last_attention_input
    (grad,) = fwd.gradients([tokens])
    scores = (tokens.detach() * grad).sum(-1)
    return scores[:, adapter.num_prefix_tokens:], fwd.indices, fwd.logits
