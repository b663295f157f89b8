"""Methods built on LRP relevance: transformer attribution (Chefer et al. CVPR'21), full LRP, partial LRP."""
from __future__ import annotations

import torch

from ..adapters.base import Adapter
from ..capture import record_forward
from ..lrp import GRADIENT, PAPER, RELEVANCE, VANILLA, RuleSet, relevance_session
from ..targets import Target
from .attention import chain, class_token_row, with_identity

WEIGHTS = ("gradient", "attention")
BLOCKS = ("all", "last", "first")


def _seed(score: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=score.dtype, device=score.device)


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}; got '{value}'")


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0, weights: str = "gradient", blocks: str = "all"
) -> tuple[torch.Tensor, ...]:
    """`C = prod_b (I + E_h (G_b * R_b)^+)` read at the [CLS] row; `R_b` is the paper-rule relevance at `A_b`.

    Ablations of the paper: `weights="attention"` uses `A_b` instead of its gradient; `blocks="last"` or
    `"first"` uses a single block instead of the rollout over all blocks from `start_layer`.
    """
    _one_of("weights", weights, WEIGHTS)
    _one_of("blocks", blocks, BLOCKS)
    with relevance_session(adapter.model, adapter.relevance_rule_map(), PAPER) as session:
        fwd = record_forward(adapter, inputs, target, gradients=True)
        attentions = session.attentions
        if not 0 <= start_layer < len(attentions):
            raise ValueError(f"start_layer must be in 0..{len(attentions) - 1}, got {start_layer}")
        used = {"all": attentions[start_layer:], "last": attentions[-1:], "first": attentions[:1]}[blocks]
        seed = _seed(fwd.score)
        factors = session.backward(GRADIENT, fwd.score.sum(), used, seed) if weights == "gradient" else [a.detach() for a in used]
        relevances = session.backward(RELEVANCE, fwd.score.sum(), used, seed)
    matrices = [with_identity((f * r).clamp(min=0).mean(1)) for f, r in zip(factors, relevances)]
    return class_token_row(chain(matrices, 0), adapter.num_prefix_tokens), fwd.indices, fwd.logits


def relevance_at_last_attention(adapter: Adapter, inputs: torch.Tensor, target: Target, rule_set: RuleSet) -> tuple[torch.Tensor, ...]:
    with relevance_session(adapter.model, adapter.relevance_rule_map(), rule_set) as session:
        fwd = record_forward(adapter, inputs, target, gradients=True)
        (relevance,) = session.backward(RELEVANCE, fwd.score.sum(), session.attentions[-1:], _seed(fwd.score))
    return relevance, fwd.indices, fwd.logits


def partial_lrp(adapter: Adapter, inputs: torch.Tensor, target: Target) -> tuple[torch.Tensor, ...]:
    """The paper's partial-LRP baseline: vanilla-rule relevance at the last attention, `E_h (R)^+` at [CLS]."""
    relevance, indices, logits = relevance_at_last_attention(adapter, inputs, target, VANILLA)
    return class_token_row(relevance.clamp(min=0).mean(1), adapter.num_prefix_tokens), indices, logits


def lrp(adapter: Adapter, inputs: torch.Tensor, target: Target) -> tuple[torch.Tensor, ...]:
    """The paper's full-LRP baseline: vanilla rules down to the pixels (z^B at the patch embedding), `(B, H, W)`."""
    with relevance_session(adapter.model, adapter.relevance_rule_map(), VANILLA) as session:
        pixels = inputs.detach().requires_grad_(True)
        fwd = record_forward(adapter, pixels, target, gradients=True)
        (relevance,) = session.backward(RELEVANCE, fwd.score.sum(), [pixels], _seed(fwd.score))
    return relevance.sum(1), fwd.indices, fwd.logits
