"""The one attention of every family and every rule set: `softmax(q k^T * scale + mask) v`, plain or under a
session's rules.

Outside a session (`session=None`) it is the exact eager attention the transformers families register
(`families/hf_attention.py`, the decoders' `causal_lm/adapter.py`); inside one it is the rule-aware forward every
family's attention runs (the explicit pass of the seeds' rule sets, the modified gradient of AttnLRP and CP-LRP),
through a thin adapter that only projects the queries, keys and values and shapes the heads. What differs
between the families' reference codes is stated as an `AttentionStyle`: where the scale is applied (their
rounding differs) and which rule the additive mask gets. The probabilities are recorded in the session.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from . import gradient
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


# keys up to which a CPU computes half-precision attention faster as eager products than with the fused kernel
EAGER_HALF_PRECISION_KEYS = 512
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


def sunk_softmax(sinks: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The softmax of scores `(B, H, ..., T, S)` with a per-head sink logit `sinks` `(H,)` (gpt-oss) in the
    denominator: `exp(s_j) / (sum_k exp(s_k) + exp(sink))` over the real keys, as the model computes it (the softmax
    over the scores and the sink's column, the column dropped), in float32 at least. The sink is a constant: its
    parameter detached (no rule gives a model's weights relevance), so a gradient flows to the scores only."""

    def probabilities(scores: torch.Tensor) -> torch.Tensor:
        sink = sinks.detach().to(scores.dtype).reshape(*scores.shape[1:-2], 1, 1).expand(*scores.shape[:-1], 1)
        return softmax_of(torch.cat([scores, sink], dim=-1))[..., :-1]

    return probabilities


def _eager_is_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the eager products beat torch's fused kernel forward and backward: on a CPU in half precision up to
    `EAGER_HALF_PRECISION_KEYS` keys (the fused kernel's backward there costs 2.5x the eager one's at 100 tokens)."""
    return q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16) and k.shape[-2] <= EAGER_HALF_PRECISION_KEYS


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, in_place: bool) -> torch.Tensor:
    """The scores with the mask applied; `in_place` where the scores are a fresh tensor no backward needs (the same
    numbers, one `(T, T)` allocation fewer)."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:  # True where attending is allowed
        blocked, value = ~mask, torch.finfo(scores.dtype).min
        return scores.masked_fill_(blocked, value) if in_place else scores.masked_fill(blocked, value)
    return scores.add_(mask) if in_place else scores + mask


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
    softcap: float | None = None,
    probabilities: bool = True,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(softmax(q k^T * scale + mask) v, probabilities)` for heads `(B, H, T, d)`; the context stays in heads.
    (`scale` is the divisor where the style divides.)

    `k` and `v` may have fewer heads than `q` (grouped-query attention): the query heads are viewed as (key heads,
    group) and broadcast against their key head, so keys and values are not copied per head (under an explicit rule
    set they are: its rules' products run as batches of matrices, and each copy's share adds up at its head). `mask`: additive (or
    boolean, True where allowed), broadcast to `(B, H, Tq, Tk)` and cut to the keys' length; `causal` without a mask
    makes the causal one. `softcap` (Gemma 2): the scores soft-capped `c tanh(s / c)` before the mask. `sinks`
    (gpt-oss): a learned logit per query head `(H,)` in the softmax's denominator (`sunk_softmax`): the
    probabilities over the real keys, returned and recorded as they are, sum to less than 1.

    Under the session's rule set: an explicit one gives the products the matmul rule, lets scale, soft-cap and mask
    pass relevance (or the mask takes its share, see `AttentionStyle`), the softmax its softmax rule, and records
    the probabilities; a gradient one shares the backward of queries, keys and values (`RuleSet.query_key`,
    `value`). Without `probabilities` (not under an explicit rule set) torch's fused kernel computes it and none
    are returned: a pass that needs the input's relevance alone keeps no `(T, T)` matrix (except where the eager
    products are faster, `_eager_is_faster`: short prompts in half precision on a CPU; and with sinks, which the
    fused kernel does not take).

    The sinks are constants of the softmax. Under an explicit rule set the softmax's rule moves the relevance of
    each real key's probability to its score (the seeds' rule sets pass it unchanged); the sink is no input of the
    attention and takes none, and what it takes of the probability mass never reaches the output, which weighs
    the values by the real keys' probabilities alone. Under a gradient rule set the scores' gradient is the
    softmax's true one, through a denominator that holds the sink (AttnLRP's softmax rule; CP-LRP holds the
    probabilities constant and gives the scores none), the sink parameter held constant.
    """
    explicit = session is not None and session.rule_set.explicit
    if session is not None and not explicit:
        rule_set = session.rule_set
        q, k, v = gradient.take(q, rule_set.query_key), gradient.take(k, rule_set.query_key), gradient.take(v, rule_set.value)
    batch, heads, length, width = q.shape
    groups = heads // k.shape[1]
    half_eager = not probabilities and not explicit and sinks is None and _eager_is_faster(q, k)
    if not probabilities and not explicit and softcap is None and sinks is None and style.scale != "divide" and not half_eager:
        if mask is not None and mask.dtype != torch.bool:
            mask = mask[..., : k.shape[-2]]
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and causal and length > 1,
                                                 scale=scale, enable_gqa=groups > 1)
        return context, None
    keys = k.shape[-2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask[..., :keys].to(q.dtype)
    elif mask is None and causal and length > 1:
        mask = causal_mask(length, keys, q)
    if style.scale == "queries":
        q = passthrough(session, lambda t: t * scale, q)
    if groups > 1 and explicit:  # the rules' products on 4-D batches of matrices (bmm), copies' shares summed back
        k, v, groups = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 1
    if explicit:  # heads cut from a fused projection are strided views: copied once here, not by each of the rules' products
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if groups > 1:  # (B, key heads, group, T, d) against (B, key heads, 1, d, S)
        q, k, v = q.view(batch, k.shape[1], groups, length, width), k.unsqueeze(2), v.unsqueeze(2)
        mask = mask.unsqueeze(2) if mask is not None and mask.ndim == 4 else mask
    products = matmul(session, q, k.transpose(-2, -1))
    # the element-wise steps between the product and the softmax pass relevance unchanged: run as one operation, so
    # that one (T, T) tensor is kept for the backward instead of one per step (the same values, in the same order)
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if style.scale == "divide":
        steps.append(lambda t: t / scale)
    elif style.scale == "multiply":
        steps.append(lambda t: t * scale)
    if softcap is not None:
        steps.append(lambda t: torch.tanh(t / softcap) * softcap)
    mask_added = style.mask == "add" and mask is not None and mask.dtype != torch.bool
    if mask is not None and not mask_added:
        fresh = bool(steps) or not explicit  # in an explicit pass the first step's input is the rule's own leaf
        steps.append(lambda t: _masked(t, mask, in_place=fresh))
    normalised = softmax_of if sinks is None else sunk_softmax(sinks)
    if mask_added:
        weights = softmax(session, add(session, _passing(session, steps, products), mask), normalised)
    elif explicit and session.rule_set.softmax is passthrough_rule:  # the softmax passes relevance too
        weights = _passing(session, [*steps, normalised], products)
    elif half_eager:  # the softmax in the input's dtype: the CPU's kernel accumulates in float32 (the same numbers
        # as the float32 softmax rounded), and the backward keeps the half-precision output only
        weights = torch.softmax(_passing(session, steps, products), dim=-1)
    else:
        weights = softmax(session, _passing(session, steps, products), normalised)
    weights = dropout(weights.flatten(1, 2) if groups > 1 else weights)  # (B, H, T, S): what the output is computed from
    if explicit:
        session.attentions.append(weights)
    context = matmul(session, weights.view(products.shape) if groups > 1 else weights, v)
    return (context.reshape(batch, heads, length, -1) if groups > 1 else context), weights
