"""Methods built on LRP relevance: transformer attribution (Chefer et al. CVPR'21), full LRP, partial LRP."""
from __future__ import annotations

import torch

from ..adapters.base import Adapter
from ..capture import record_forward
from ..lrp import GRADIENT, PAPER, RELEVANCE, VANILLA, RuleSet, relevance_session
from ..targets import Target, resolve_target, target_score
from .attention import chain, class_token_row, family_option, set_class_entry, token_mask, with_identity

WEIGHTS = ("gradient", "attention")
BLOCKS = ("all", "last", "first")


def _seed(score: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=score.dtype, device=score.device)


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}; got '{value}'")


RULE_SETS = {"vanilla": VANILLA, "paper": PAPER}


def _rule_set(adapter: Adapter, method: str, rules: str | None) -> RuleSet:
    """The LRP-baseline rules: "vanilla" (`layers_lrp`, the ViT reference) or "paper" (`layers_ours`: the BERT
    reference uses these for its baselines too); the adapter's family default when not given."""
    name = family_option(adapter, method, "rules", rules, "vanilla")
    _one_of("rules", name, tuple(RULE_SETS))
    return RULE_SETS[name]


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0, weights: str = "gradient", blocks: str = "all",
    row_normalize: bool | None = None, cls_entry: str | None = None, exact: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`C = prod_b (I + E_h (G_b * R_b)^+)` read at the [CLS] row; `R_b` is the paper-rule relevance at `A_b`.

    Ablations of the paper: `weights="attention"` uses `A_b` instead of its gradient; `blocks="last"` or
    `"first"` uses a single block instead of the rollout over all blocks from `start_layer`.
    `row_normalize` divides each `I + E_h(...)` by its row sums (the BERT reference; ViT: no), `cls_entry`:
    see `set_class_entry` (the BERT reference sets it to the row's "min").
    """
    _one_of("weights", weights, WEIGHTS)
    _one_of("blocks", blocks, BLOCKS)
    with relevance_session(adapter.model, adapter.relevance_rule_map(), PAPER, exact=exact) as session:
        fwd = record_forward(adapter, inputs, target, gradients=True)
        attentions = session.attentions
        if not 0 <= start_layer < len(attentions):
            raise ValueError(f"start_layer must be in 0..{len(attentions) - 1}, got {start_layer}")
        used = {"all": attentions[start_layer:], "last": attentions[-1:], "first": attentions[:1]}[blocks]
        seed = _seed(fwd.score)
        factors = session.backward(GRADIENT, fwd.score.sum(), used, seed) if weights == "gradient" else [a.detach() for a in used]
        matrices = combine_on_arrival(session, fwd.score.sum(), used, seed, factors)
    if family_option(adapter, "transformer_attribution", "row_normalize", row_normalize, False):
        matrices = [m / m.sum(-1, keepdim=True) for m in matrices]
    scores = class_token_row(chain(matrices, 0), adapter.num_prefix_tokens)
    how = family_option(adapter, "transformer_attribution", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), fwd.indices, fwd.logits


def combine_on_arrival(session, score: torch.Tensor, attentions: list[torch.Tensor], seed: torch.Tensor, factors: list) -> list[torch.Tensor]:
    """Relevance pass: as each block's relevance `R_b` arrives, reduce it at once to `I + E_h (F_b * R_b)^+`.

    Keeps one `(B, T, T)` matrix per block instead of every `(B, heads, T, T)` relevance and factor.
    """
    matrices: list = [None] * len(attentions)

    def reducer(index: int):
        def hook(relevance: torch.Tensor) -> None:
            matrices[index] = with_identity((factors[index] * relevance).clamp(min=0).mean(1))
            factors[index] = None

        return hook

    handles = [a.register_hook(reducer(i)) for i, a in enumerate(attentions)]
    try:
        session.backward(RELEVANCE, score, attentions[:1], seed)  # the earliest block: the pass crosses all
    finally:
        for handle in handles:
            handle.remove()
    return matrices


def relevance_at_last_attention(adapter: Adapter, inputs: torch.Tensor, target: Target, rule_set: RuleSet, exact: bool) -> tuple[torch.Tensor, ...]:
    with relevance_session(adapter.model, adapter.relevance_rule_map(), rule_set, exact=exact) as session:
        fwd = record_forward(adapter, inputs, target, gradients=True)
        (relevance,) = session.backward(RELEVANCE, fwd.score.sum(), session.attentions[-1:], _seed(fwd.score))
    return relevance, fwd.indices, fwd.logits


def partial_lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple[torch.Tensor, ...]:
    """The paper's partial-LRP baseline: vanilla-rule relevance at the last attention, `E_h (R)^+` at [CLS].

    `rules`: see `_rule_set` (BERT: "paper"); `cls_entry`: see `set_class_entry` (BERT: "zero").
    """
    relevance, indices, logits = relevance_at_last_attention(adapter, inputs, target, _rule_set(adapter, "partial_lrp", rules), exact)
    scores = class_token_row(relevance.clamp(min=0).mean(1), adapter.num_prefix_tokens)
    how = family_option(adapter, "partial_lrp", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), indices, logits


def lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple[torch.Tensor, ...]:
    """The paper's full-LRP baseline: vanilla rules down to the pixels (z^B at the patch embedding), `(B, H, W)`.

    Text models: relevance at the embedding output summed over the hidden dimension, `(B, T)` (the BERT
    reference's `generate_full_lrp`). `rules`: see `_rule_set` (BERT: "paper"); `cls_entry`: see
    `set_class_entry` (BERT: "zero").
    """
    with relevance_session(adapter.model, adapter.relevance_rule_map(), _rule_set(adapter, "lrp", rules), exact=exact) as session:
        if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            pixels = inputs.detach().requires_grad_(True)
            fwd = record_forward(adapter, pixels, target, gradients=True)
            (relevance,) = session.backward(RELEVANCE, fwd.score.sum(), [pixels], _seed(fwd.score))
            return relevance.sum(1), fwd.indices, fwd.logits
        with torch.enable_grad():
            tokens = adapter.embed(inputs).detach().requires_grad_(True)
            logits, pre_logits = adapter.forward_tokens(tokens)
            indices = resolve_target(target, logits)
            score = target_score(target, indices, logits, pre_logits)
        (relevance,) = session.backward(RELEVANCE, score.sum(), [tokens], _seed(score))
    scores = relevance.sum(-1)
    valid = token_mask(adapter, inputs)
    if valid is not None:
        scores = scores.masked_fill(~valid, 0)
    how = family_option(adapter, "lrp", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, adapter, inputs), indices, logits.detach()
