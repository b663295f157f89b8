"""The one attention of every family: `softmax(q k^T * scale + mask) v`, plain or under a session's rules.

Outside a session (`session=None`) it is the exact eager attention the transformers families register
(`families/hf_attention.py`); inside one it is the rule-aware forward every family's attention module is patched
with, through a thin adapter that only projects the queries, keys and values and shapes the heads. What differs
between the families' reference codes is stated as an `AttentionStyle`: where the scale is applied (their
rounding differs) and which rule the additive mask gets. The probabilities are recorded in the session.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from .engine import Session, add, matmul, passthrough, passthrough_rule, softmax, softmax_of


@dataclass(frozen=True)
class AttentionStyle:
    """How a reference orders the attention's arithmetic (the rounding of near-zero products matters to LRP).

    `scale`: "multiply" the products by the scale, "divide" them by it (the caller then passes the divisor: the
    authors' BERT and LXMERT divide by `sqrt(d)`), or multiply the "queries" before the product (the authors' DETR). `mask`: the additive mask passes
    relevance with the scores ("passthrough") or takes its share under the add rule ("add", the authors' BERT).
    """

    scale: Literal["multiply", "divide", "queries"] = "multiply"
    mask: Literal["passthrough", "add"] = "passthrough"


MULTIPLIED = AttentionStyle()
SCALED_QUERIES = AttentionStyle(scale="queries")


def causal_mask(queries: int, keys: int, like: torch.Tensor) -> torch.Tensor:
    """The additive mask that keeps query `i` from keys after it, in `like`'s dtype and device."""
    blocked = torch.ones(queries, keys, dtype=torch.bool, device=like.device).triu(1)
    return torch.zeros(queries, keys, dtype=like.dtype, device=like.device).masked_fill(blocked, torch.finfo(like.dtype).min)


def _passing(session: Session | None, steps: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """`x` through `steps` in order, as one operation that passes relevance unchanged (`x` itself for no steps)."""
    if not steps:
        return x

    def run(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t

    return passthrough(session, run, x)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return scores
    if mask.dtype == torch.bool:  # True where attending is allowed
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask


def attend(
    session: Session | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    *,
    style: AttentionStyle = MULTIPLIED,
    causal: bool = False,
    dropout: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(softmax(q k^T * scale + mask) v, probabilities)` for heads `(B, H, T, d)`; the context stays in heads.
    (`scale` is the divisor where the style divides.)

    `mask`: additive (or boolean, True where allowed), broadcast to `(B, H, Tq, Tk)` and cut to the keys' length;
    `causal` without a mask makes the causal one. The products get the session's matmul rule, scale and mask pass
    relevance (or the mask takes its share, see `AttentionStyle`), the softmax gets the session's softmax rule.
    """
    keys = k.shape[-2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask[..., :keys].to(q.dtype)
    elif mask is None and causal and q.shape[-2] > 1:
        mask = causal_mask(q.shape[-2], keys, q)
    if style.scale == "queries":
        q = passthrough(session, lambda t: t * scale, q)
    products = matmul(session, q, k.transpose(-2, -1))
    # the element-wise steps between the product and the softmax pass relevance unchanged: run as one operation, so
    # that one (T, T) tensor is kept for the backward instead of one per step (the same values, in the same order)
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if style.scale == "divide":
        steps.append(lambda t: t / scale)
    elif style.scale == "multiply":
        steps.append(lambda t: t * scale)
    mask_added = style.mask == "add" and mask is not None and mask.dtype != torch.bool
    if mask is not None and not mask_added:
        steps.append(lambda t: _masked(t, mask))
    if mask_added:
        probabilities = softmax(session, add(session, _passing(session, steps, products), mask))
    elif session is not None and session.rule_set.softmax is passthrough_rule:  # the softmax passes relevance too
        probabilities = _passing(session, [*steps, softmax_of], products)
    else:
        probabilities = softmax(session, _passing(session, steps, products))
    probabilities = dropout(probabilities)
    if session is not None:
        session.attentions.append(probabilities)
    return matmul(session, probabilities, v), probabilities
