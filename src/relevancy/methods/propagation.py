"""Methods built on LRP relevance: transformer attribution (Chefer et al. CVPR'21), full LRP, partial LRP."""
from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

from ..families.base import Adapter, only_stream
from ..capture import record_forward
from ..lrp import GRADIENT, PAPER, RELEVANCE, VANILLA, RuleSet, relevance_session
from ..targets import Target, resolve_target, target_score
from ..streams import Stream
from .attention import chain, family_option, readout_row, set_class_entry, with_identity

WEIGHTS = ("gradient", "attention")
# the paper's rules conserve relevance: a total further than this from 1 marks a degenerate map (warned)
CONSERVATION_TOLERANCE = 1e-2
LOW_PRECISION = (torch.float16, torch.bfloat16)
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


@contextmanager
def block_input(adapter: Adapter, index: int) -> Iterator[list[torch.Tensor]]:
    """Records the tokens entering `adapter.blocks[index]` during the block (to measure relevance there)."""
    seen: list[torch.Tensor] = []
    handle = adapter.blocks[index].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def conservation(relevance: torch.Tensor, rule_set: RuleSet, method: str) -> dict:
    """`{"relevance_total": (B,)}`, the total relevance per input (1 enters at the explained score); a warning
    when it is not finite, or when rules that conserve (the paper's) lost more than `CONSERVATION_TOLERANCE`."""
    totals = relevance.detach().flatten(1).sum(1)
    if not torch.isfinite(totals).all():
        warnings.warn(f"{method}: the relevance total is not finite for some inputs; their maps are degenerate", stacklevel=4)
    elif rule_set is PAPER and ((totals - 1).abs() > CONSERVATION_TOLERANCE).any():
        worst = totals[(totals - 1).abs().argmax()].item()
        warnings.warn(
            f"{method}: the relevance total is {worst:.4g} where the paper's rules conserve 1 (tolerance "
            f"{CONSERVATION_TOLERANCE}); the map may be degenerate (see Explanation.relevance_total)", stacklevel=4,
        )
    return {"relevance_total": totals}


@contextmanager
def full_precision(adapter: Adapter, inputs) -> Iterator[tuple[Adapter, object]]:
    """fp16 / bf16 models are explained through a float32 copy (the model itself untouched): the LRP rules
    divide by sums that half precision cannot resolve. Other models are used as they are."""
    param = next(adapter.model.parameters(), None)
    if param is None or param.dtype not in LOW_PRECISION:
        yield adapter, inputs
        return
    twin = copy.deepcopy(adapter.model).float()
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        inputs = inputs.float()
    yield type(adapter)(twin), inputs


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: int = 0, weights: str = "gradient", blocks: str = "all",
    row_normalize: bool | None = None, cls_entry: str | None = None, exact: bool = False,
) -> tuple:
    """`C = prod_b (I + E_h (G_b * R_b)^+)` read at the [CLS] row; `R_b` is the paper-rule relevance at `A_b`.

    Ablations of the paper: `weights="attention"` uses `A_b` instead of its gradient; `blocks="last"` or
    `"first"` uses a single block instead of the rollout over all blocks from `start_layer`.
    `row_normalize` divides each `I + E_h(...)` by its row sums (the BERT reference; ViT: no), `cls_entry`:
    see `set_class_entry` (the BERT reference sets it to the row's "min"). `exact`: the authors' arithmetic
    (see relevancy.lrp.rules) instead of the stable default.
    """
    _one_of("weights", weights, WEIGHTS)
    _one_of("blocks", blocks, BLOCKS)
    stream = only_stream(adapter, inputs, "transformer_attribution")
    depth = len(adapter.blocks)
    if not 0 <= start_layer < depth:
        raise ValueError(f"start_layer must be in 0..{depth - 1}, got {start_layer}")
    first = {"all": start_layer, "last": depth - 1, "first": 0}[blocks]
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        model = adapter32.model
        with relevance_session(model, adapter32.relevance_rule_map(), PAPER, exact=exact) as session, block_input(adapter32, first) as entering:
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            attentions = session.attentions
            used = {"all": attentions[start_layer:], "last": attentions[-1:], "first": attentions[:1]}[blocks]
            seed = _seed(fwd.score)
            factors = session.backward(GRADIENT, fwd.score.sum(), used, seed) if weights == "gradient" else [a.detach() for a in used]
            matrices, arrived = combine_on_arrival(session, fwd.score.sum(), used, seed, factors, entering[0])
    if family_option(adapter, "transformer_attribution", "row_normalize", row_normalize, False):
        matrices = [m / m.sum(-1, keepdim=True) for m in matrices]
    scores = readout_row(chain(matrices, 0), stream)
    how = family_option(adapter, "transformer_attribution", "cls_entry", cls_entry, "keep")
    details = conservation(masked(stream, arrived), PAPER, "transformer_attribution")
    return set_class_entry(scores, how, stream), fwd.indices, fwd.logits, details


def masked(stream: Stream, relevance: torch.Tensor) -> torch.Tensor:
    """Token relevance `(B, T, ...)` with padding tokens zeroed (families that pad)."""
    valid = stream.valid
    if valid is None:
        return relevance
    return relevance * valid.reshape(*valid.shape, *([1] * (relevance.ndim - 2))).to(relevance)


def combine_on_arrival(
    session, score: torch.Tensor, attentions: list[torch.Tensor], seed: torch.Tensor, factors: list, tokens: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Relevance pass: as each block's relevance `R_b` arrives, reduce it at once to `I + E_h (F_b * R_b)^+`.

    Keeps one `(B, T, T)` matrix per block instead of every `(B, heads, T, T)` relevance and factor. The pass
    goes on to `tokens` (the input of the earliest block used), whose relevance is returned too.
    """
    matrices: list = [None] * len(attentions)

    def reducer(index: int):
        def hook(relevance: torch.Tensor) -> None:
            matrices[index] = with_identity((factors[index] * relevance).clamp(min=0).mean(1))
            factors[index] = None

        return hook

    handles = [a.register_hook(reducer(i)) for i, a in enumerate(attentions)]
    try:
        (arrived,) = session.backward(RELEVANCE, score, [tokens], seed)  # crosses every block used
    finally:
        for handle in handles:
            handle.remove()
    return matrices, arrived


def partial_lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The paper's partial-LRP baseline: vanilla-rule relevance at the last attention, `E_h (R)^+` at [CLS].

    `rules`: see `_rule_set` (BERT: "paper"); `cls_entry`: see `set_class_entry` (BERT: "zero"); `exact`: the
    authors' arithmetic.
    """
    rule_set = _rule_set(adapter, "partial_lrp", rules)
    stream = only_stream(adapter, inputs, "partial_lrp")
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set, exact=exact) as session, \
                block_input(adapter32, len(adapter32.blocks) - 1) as entering:
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            relevance, arrived = session.backward(RELEVANCE, fwd.score.sum(), [session.attentions[-1], entering[0]], _seed(fwd.score))
    scores = readout_row(relevance.clamp(min=0).mean(1), stream)
    how = family_option(adapter, "partial_lrp", "cls_entry", cls_entry, "keep")
    details = conservation(masked(stream, arrived), rule_set, "partial_lrp")
    return set_class_entry(scores, how, stream), fwd.indices, fwd.logits, details


def lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The paper's full-LRP baseline: vanilla rules down to the pixels (z^B at the patch embedding), `(B, H, W)`.

    Text models: relevance at the embedding output summed over the hidden dimension, `(B, T)` (the BERT
    reference's `generate_full_lrp`). `rules`: see `_rule_set` (BERT: "paper"); `cls_entry`: see
    `set_class_entry` (BERT: "zero"); `exact`: the authors' arithmetic.
    """
    rule_set = _rule_set(adapter, "lrp", rules)
    stream = only_stream(adapter, inputs, "lrp")
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set, exact=exact) as session:
            if stream.kind == "image":
                pixels = inputs32.detach().requires_grad_(True)
                fwd = record_forward(adapter32, pixels, target, gradients=True)
                (relevance,) = session.backward(RELEVANCE, fwd.score.sum(), [pixels], _seed(fwd.score))
                scores = relevance.sum(1)
                return scores, fwd.indices, fwd.logits, conservation(scores, rule_set, "lrp")
            with torch.enable_grad():
                tokens = adapter32.embed(inputs32)[stream.name].detach().requires_grad_(True)
                logits, pre_logits = adapter32.forward_tokens(inputs32, {stream.name: tokens})
                indices = resolve_target(target, logits)
                score = target_score(target, indices, logits, pre_logits)
            (relevance,) = session.backward(RELEVANCE, score.sum(), [tokens], _seed(score))
    scores = masked(stream, relevance).sum(-1)
    details = conservation(scores, rule_set, "lrp")
    how = family_option(adapter, "lrp", "cls_entry", cls_entry, "keep")
    return set_class_entry(scores, how, stream), indices, logits.detach(), details
