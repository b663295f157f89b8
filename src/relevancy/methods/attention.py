"""Methods that read attention probabilities only: raw attention and rollout (no gradients)."""
from __future__ import annotations

import torch

from ..families.base import Adapter
from ..capture import record_forward
from ..targets import Target


CLASS_ENTRIES = ("keep", "zero", "min")


def family_option(adapter: Adapter, method: str, option: str, value, fallback):
    """`value` when the caller gave one, else the model family's default for `method` (`adapter.method_defaults`,
    where a family's reference code differs from the ViT one), else `fallback` (the ViT reference's choice)."""
    if value is not None:
        return value
    return getattr(adapter, "method_defaults", {}).get(method, {}).get(option, fallback)


def token_mask(adapter: Adapter, inputs) -> torch.Tensor | None:
    """`(B, T)` bool of the real tokens for families that pad (text), None when every token is real."""
    mask = getattr(adapter, "token_mask", None)
    return mask(inputs) if mask is not None else None


def set_class_entry(scores: torch.Tensor, how: str, adapter: Adapter, inputs) -> torch.Tensor:
    """The [CLS] token's own entry of a [CLS]-row map read over all tokens (`num_prefix_tokens == 0`, text models):
    "keep" it, set it to "zero", or to the row's "min" over the real tokens. Maps without that column are unchanged."""
    if how not in CLASS_ENTRIES:
        raise ValueError(f"cls_entry must be one of {', '.join(CLASS_ENTRIES)}, got {how!r}")
    if how == "keep" or adapter.num_prefix_tokens != 0 or not adapter.has_class_token:
        return scores
    scores = scores.clone()
    if how == "zero":
        scores[:, 0] = 0
    else:
        valid = token_mask(adapter, inputs)
        row = scores if valid is None else scores.masked_fill(~valid, float("inf"))
        scores[:, 0] = row.amin(-1)
    return scores


def class_token_row(matrix: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The [CLS] row of a `(B, T, T)` token matrix at the patch columns: `(B, N)`."""
    return matrix[:, 0, num_prefix_tokens:]


def chain(matrices: list[torch.Tensor], start_layer: int) -> torch.Tensor:
    """`M_last @ ... @ M_start`: how the first block's tokens reach the last block's output."""
    if not 0 <= start_layer < len(matrices):
        raise ValueError(f"start_layer must be in 0..{len(matrices) - 1} for a model with {len(matrices)} blocks, got {start_layer}")
    joint = matrices[start_layer]
    for matrix in matrices[start_layer + 1:]:
        joint = matrix @ joint
    return joint


def with_identity(matrix: torch.Tensor) -> torch.Tensor:
    """`I + M`, the residual connection's share."""
    return matrix + torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)


def raw_attention(adapter: Adapter, inputs: torch.Tensor, target: Target, cls_entry: str | None = None) -> tuple[torch.Tensor, ...]:
    """`cls_entry`: see `set_class_entry` (text models: the BERT reference sets it to "zero")."""
    fwd = record_forward(adapter, inputs, target, attentions=True)
    last = fwd.attentions[-1].mean(1)
    scores = class_token_row(last, adapter.num_prefix_tokens)
    how = family_option(adapter, "raw_attention", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), fwd.indices, fwd.logits


def rollout(adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0, cls_entry: str | None = None) -> tuple[torch.Tensor, ...]:
    """`cls_entry`: see `set_class_entry` (text models: the BERT reference sets it to "zero")."""
    fwd = record_forward(adapter, inputs, target, attentions=True)
    matrices = [with_identity(a.mean(1)) for a in fwd.attentions]
    matrices = [m / m.sum(-1, keepdim=True) for m in matrices]
    scores = class_token_row(chain(matrices, start_layer), adapter.num_prefix_tokens)
    how = family_option(adapter, "rollout", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), fwd.indices, fwd.logits
