"""Methods that read attention probabilities only: raw attention and rollout (no gradients)."""
from __future__ import annotations

import torch

from ..adapters.base import Adapter
from ..capture import record_forward
from ..targets import Target


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


def raw_attention(adapter: Adapter, inputs: torch.Tensor, target: Target) -> tuple[torch.Tensor, ...]:
    fwd = record_forward(adapter, inputs, target, attentions=True)
    last = fwd.attentions[-1].mean(1)
    return class_token_row(last, adapter.num_prefix_tokens), fwd.indices, fwd.logits


def rollout(adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0) -> tuple[torch.Tensor, ...]:
    fwd = record_forward(adapter, inputs, target, attentions=True)
    matrices = [with_identity(a.mean(1)) for a in fwd.attentions]
    matrices = [m / m.sum(-1, keepdim=True) for m in matrices]
    return class_token_row(chain(matrices, start_layer), adapter.num_prefix_tokens), fwd.indices, fwd.logits
