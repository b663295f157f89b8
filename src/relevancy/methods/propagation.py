"""Methods built on LRP relevance: transformer attribution (Chefer et al. CVPR'21), full LRP, partial LRP."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

from ..families.base import Adapter, only_stream
from ..capture import Forward, record_forward
from ..conventions import ClassEntry, LrpConventions, RuleName, check_choice, given_or
from ..lrp import GRADIENT, PAPER, RELEVANCE, VANILLA, RuleSet, Session, relevance_session
from ..targets import Target, resolve_target, target_score
from ..streams import Stream
from . import coattention
from .attention import StartLayer, chain, first_layer, read_cross, readout_row, set_class_entry, with_identity

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


def _rule_set(rules: str | None, conventions: LrpConventions) -> RuleSet:
    """The LRP-baseline rules: "vanilla" (`layers_lrp`, the ViT reference) or "paper" (`layers_ours`: the BERT
    reference uses these for its baselines too); the family's convention when not given."""
    return RULE_SETS[check_choice("rules", given_or(rules, conventions.rules), RuleName)]


def stream_depths(adapter: Adapter, streams: dict[str, Stream]) -> dict[str, int]:
    """Per stream, its number of self-attention blocks (from the adapter's attention sites)."""
    sites = adapter.attention_sites()
    return {name: sum(site.is_self and site.query == name for site in sites) for name in streams}


def stream_attentions(adapter: Adapter, session: Session, streams: dict[str, Stream]) -> dict[str, list[torch.Tensor]]:
    """Per stream, the self-attentions the rule map recorded, block by block: the session records every attention
    in forward order, the order of `adapter.attention_sites()`."""
    sites = adapter.attention_sites()
    if len(sites) != len(session.attentions):
        raise RuntimeError(
            f"the relevance rules recorded {len(session.attentions)} attentions where the model has {len(sites)} "
            "attention sites: the rule map and the adapter disagree"
        )
    found: dict[str, list[torch.Tensor]] = {name: [] for name in streams}
    for site, attention in zip(sites, session.attentions):
        if site.is_self:
            found[site.query].append(attention)
    return found


@contextmanager
def recording_block_inputs(adapter: Adapter, session: Session, streams: dict[str, Stream]) -> Iterator[None]:
    """One-stream families: hooks on `adapter.blocks` fill `session.block_inputs` (the tokens entering each block,
    where relevance is measured) during the block. The rule maps of multi-stream families record them themselves."""
    if not adapter.blocks:
        yield
        return
    (name,) = streams
    handles = [
        block.register_forward_pre_hook(lambda _m, args: session.block_inputs.setdefault(name, []).append(args[0]))
        for block in adapter.blocks
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def entering(session: Session, stream: str, block: int) -> torch.Tensor:
    """The tokens that entered block `block` of `stream` in the session's forward pass."""
    recorded = session.block_inputs.get(stream, [])
    if not -len(recorded) <= block < len(recorded):
        raise RuntimeError(f"the relevance rules recorded no input of block {block} of the {stream} stream")
    return recorded[block]


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
    yield type(adapter)(twin), _float32(inputs)


def _float32(inputs):
    """A float input tensor in float32; a batch object (a dataclass, e.g. CLIP's images and texts) with its float
    tensors in float32; anything else as it is."""
    if isinstance(inputs, torch.Tensor):
        return inputs.float() if inputs.is_floating_point() else inputs
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        values = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs) if f.init}
        floats = {name: v.float() for name, v in values.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        return dataclasses.replace(inputs, **floats) if floats else inputs
    return inputs


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: StartLayer = 0, weights: str = "gradient",
    blocks: str = "all", row_normalize: bool | None = None, cls_entry: str | None = None, exact: bool = False,
) -> tuple:
    """`C = prod_b (I + E_h (G_b * R_b)^+)` read at the readout row, per stream; `R_b` is the paper-rule relevance
    at `A_b`.

    Ablations of the paper: `weights="attention"` uses `A_b` instead of its gradient; `blocks="last"` or
    `"first"` uses a single block instead of the rollout over all blocks from `start_layer` (a block index,
    negative from the end; a dict: one per stream). `row_normalize` divides each `I + E_h(...)` by its row sums
    (the BERT reference; ViT: no), `cls_entry`: see `set_class_entry` (the BERT reference sets it to the row's
    "min"). `exact`: the authors' arithmetic (see relevancy.lrp.rules) instead of the stable default.
    Several streams (CLIP): one relevance pass serves every stream; each stream's map reads its own attentions,
    and `relevance_total` is `(B, streams)`, the relevance reaching each stream's earliest block used (see the
    family's rules for what each stream receives; CLIP: 1 per tower).
    Models whose streams attend to each other (DETR, LXMERT): the authors' `generate_transformer_att`, `E_h (G * R)^+`
    of the readout stream's last attention into each stream, read at the readout row (`start_layer`, `blocks` and
    `row_normalize` do not apply); where the family's convention `readout_rollout` is set (LXMERT), the readout
    stream's own map is instead the rollout `prod (I + E_h (G * R)^+)` over all of its self-attentions;
    `relevance_total` `(B, streams)`: the relevance reaching each stream's input.
    """
    _one_of("weights", weights, WEIGHTS)
    _one_of("blocks", blocks, BLOCKS)
    conventions = adapter.conventions.transformer_attribution
    how = given_or(cls_entry, conventions.cls_entry)
    if coattention.has_cross_attention(adapter):
        given = {"start_layer": start_layer != 0, "blocks": blocks != "all", "row_normalize": row_normalize is not None}
        if any(given.values()):
            raise ValueError(
                f"{', '.join(n for n, g in given.items() if g)} apply to self-attention models; on models whose streams "
                "attend to each other transformer_attribution reads the last attention into each stream"
            )
        return _cross_transformer_attribution(adapter, inputs, target, weights, how, exact)
    streams = adapter.streams(inputs)
    depths = stream_depths(adapter, streams)
    first = {}
    for name, stream in streams.items():
        start = first_layer(start_layer, stream, depths[name])
        first[name] = {"all": start, "last": depths[name] - 1, "first": 0}[blocks]
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        model = adapter32.model
        with relevance_session(model, adapter32.relevance_rule_map(), PAPER, exact=exact) as session, \
                recording_block_inputs(adapter32, session, streams):
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            recorded = stream_attentions(adapter32, session, streams)
            used = {name: recorded[name][first[name]:] if blocks == "all" else [recorded[name][first[name]]] for name in streams}
            flat = [attention for name in streams for attention in used[name]]
            seed = _seed(fwd.score)
            factors = session.backward(GRADIENT, fwd.score.sum(), flat, seed) if weights == "gradient" else [a.detach() for a in flat]
            tokens = [entering(session, name, first[name]) for name in streams]
            matrices, arrived = combine_on_arrival(session, fwd.score.sum(), flat, seed, factors, tokens)
    normalize = given_or(row_normalize, conventions.row_normalize)
    label = "transformer_attribution"
    scores, totals, pending = {}, [], iter(matrices)
    for (name, stream), relevance in zip(streams.items(), arrived):
        stream_matrices = [next(pending) for _ in used[name]]
        if normalize:
            stream_matrices = [m / m.sum(-1, keepdim=True) for m in stream_matrices]
        scores[name] = set_class_entry(readout_row(chain(stream_matrices, 0), stream), how, stream)
        where = label if len(streams) == 1 else f"{label} ({name} stream)"
        totals.append(conservation(masked(stream, relevance), PAPER, where)["relevance_total"])
    return _per_stream_result(scores, totals, fwd)


def _per_stream_result(scores: dict[str, torch.Tensor], totals: list[torch.Tensor], fwd) -> tuple:
    """A one-stream family's `(scores, indices, logits, {"relevance_total": (B,)})`; several streams: the scores
    per stream and the totals as `(B, streams)` columns, in stream order."""
    if len(scores) == 1:
        return next(iter(scores.values())), fwd.indices, fwd.logits, {"relevance_total": totals[0]}
    return scores, fwd.indices, fwd.logits, {"relevance_total": torch.stack(totals, 1)}


def masked(stream: Stream, relevance: torch.Tensor) -> torch.Tensor:
    """Token relevance `(B, T, ...)` with padding tokens zeroed (families that pad)."""
    valid = stream.valid
    if valid is None:
        return relevance
    return relevance * valid.reshape(*valid.shape, *([1] * (relevance.ndim - 2))).to(relevance)


def combine_on_arrival(
    session, score: torch.Tensor, attentions: list[torch.Tensor], seed: torch.Tensor, factors: list, tokens: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Relevance pass: as each block's relevance `R_b` arrives, reduce it at once to `I + E_h (F_b * R_b)^+`.

    Keeps one `(B, T, T)` matrix per block instead of every `(B, heads, T, T)` relevance and factor. The pass
    goes on to `tokens` (per stream, the input of the earliest block used), whose relevances are returned too.
    """
    matrices: list = [None] * len(attentions)

    def reducer(index: int):
        def hook(relevance: torch.Tensor) -> None:
            matrices[index] = with_identity((factors[index] * relevance).clamp(min=0).mean(1))
            factors[index] = None

        return hook

    handles = [a.register_hook(reducer(i)) for i, a in enumerate(attentions)]
    try:
        arrived = session.backward(RELEVANCE, score, tokens, seed)  # crosses every block used
    finally:
        for handle in handles:
            handle.remove()
    return matrices, arrived


def partial_lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The paper's partial-LRP baseline: vanilla-rule relevance at the last attention, `E_h (R)^+` at the readout
    row, per stream (`relevance_total` as in `transformer_attribution`, at each stream's last block input).

    `rules`: see `_rule_set` (BERT, DETR: "paper"); `cls_entry`: see `set_class_entry` (BERT: "zero"); `exact`: the
    authors' arithmetic.
    Models whose streams attend to each other (the authors' DETR `generate_partial_lrp`): the head mean of the
    relevance at the readout stream's last attention into each stream, unclamped, min-max normalised over the
    whole matrix (every query, real tokens), read at the readout row; `relevance_total` as in
    `transformer_attribution`.
    """
    rule_set = _rule_set(rules, adapter.conventions.partial_lrp)
    how = given_or(cls_entry, adapter.conventions.partial_lrp.cls_entry)
    if coattention.has_cross_attention(adapter):
        return _cross_partial_lrp(adapter, inputs, target, rule_set, how, exact)
    streams = adapter.streams(inputs)
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set, exact=exact) as session, \
                recording_block_inputs(adapter32, session, streams):
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            recorded = stream_attentions(adapter32, session, streams)
            lasts = [recorded[name][-1] for name in streams]
            tokens = [entering(session, name, -1) for name in streams]
            found = session.backward(RELEVANCE, fwd.score.sum(), lasts + tokens, _seed(fwd.score))
    scores, totals = {}, []
    for (name, stream), relevance, arrived in zip(streams.items(), found[:len(streams)], found[len(streams):]):
        scores[name] = set_class_entry(readout_row(relevance.clamp(min=0).mean(1), stream), how, stream)
        where = "partial_lrp" if len(streams) == 1 else f"partial_lrp ({name} stream)"
        totals.append(conservation(masked(stream, arrived), rule_set, where)["relevance_total"])
    return _per_stream_result(scores, totals, fwd)


def lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The paper's full-LRP baseline: vanilla rules down to the pixels (z^B at the patch embedding), `(B, H, W)`.

    Text models: relevance at the embedding output summed over the hidden dimension, `(B, T)` (the BERT
    reference's `generate_full_lrp`). `rules`: see `_rule_set` (BERT: "paper"); `cls_entry`: see
    `set_class_entry` (BERT: "zero"); `exact`: the authors' arithmetic.
    """
    rule_set = _rule_set(rules, adapter.conventions.lrp)
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
    return set_class_entry(scores, given_or(cls_entry, adapter.conventions.lrp.cls_entry), stream), indices, logits.detach(), details


# -- models whose streams attend to each other ------------------------------------------------------------
@dataclasses.dataclass
class SiteRelevance:
    """What one forward under a family's relevance rules gives at some attention sites: the forward, the sites'
    probabilities (detached), the score's gradient (None unless asked) and relevance at them, and per stream the
    relevance reaching its input tokens `(B, streams)`."""

    forward: Forward
    attentions: list[torch.Tensor]
    gradients: list[torch.Tensor] | None
    relevances: list[torch.Tensor]
    totals: torch.Tensor


def site_relevance(
    adapter: Adapter, inputs, target: Target, rule_set: RuleSet, exact: bool, picked: list[int], method: str,
    gradients: bool = True,
) -> SiteRelevance:
    """Gradient and relevance at the attention sites `picked` (indices into `adapter.attention_sites()`), from one
    forward under the family's rule map (which records every attention and each stream's input tokens)."""
    streams = adapter.streams(inputs)
    sites = adapter.attention_sites()
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set, exact=exact) as session:
            fwd = record_forward(adapter32, inputs32, target, gradients=True)
            if len(session.attentions) != len(sites):
                raise RuntimeError(
                    f"the relevance rules recorded {len(session.attentions)} attentions where the model has {len(sites)} "
                    "attention sites: the rule map and the adapter disagree"
                )
            attentions = [session.attentions[k] for k in picked]
            seed = _seed(fwd.score)
            grads = session.backward(GRADIENT, fwd.score.sum(), attentions, seed) if gradients else None
            tokens = [entering(session, name, 0) for name in streams]
            found = session.backward(RELEVANCE, fwd.score.sum(), attentions + tokens, seed)
    relevances, arrived = found[:len(attentions)], found[len(attentions):]
    totals = torch.stack([masked(stream, r).flatten(1).sum(1) for stream, r in zip(streams.values(), arrived)], 1)
    if not torch.isfinite(totals).all():
        warnings.warn(f"{method}: the relevance total is not finite for some inputs; their maps are degenerate", stacklevel=3)
    return SiteRelevance(fwd, [a.detach() for a in attentions], grads, relevances, totals)


def _last_sites(adapter: Adapter, inputs) -> dict[str, int]:
    """Per stream, the readout stream's last attention into it."""
    streams = adapter.streams(inputs)
    return coattention.last_sites(adapter.attention_sites(), coattention.readout_stream(streams).name, streams)


def _cross_transformer_attribution(adapter: Adapter, inputs, target: Target, weights: str, how: ClassEntry, exact: bool) -> tuple:
    reader = coattention.readout_stream(adapter.streams(inputs)).name
    last = _last_sites(adapter, inputs)
    rollout = adapter.conventions.transformer_attribution.readout_rollout
    own = [k for k, site in enumerate(adapter.attention_sites()) if site.is_self and site.query == reader] if rollout else [last[reader]]
    others = [x for x in last if x != reader]
    found = site_relevance(adapter, inputs, target, PAPER, exact, own + [last[x] for x in others], "transformer_attribution",
                           gradients=weights == "gradient")
    factors = found.gradients if weights == "gradient" else found.attentions
    cams = coattention.gradient_weighted(factors, found.relevances)
    matrices = dict(zip(others, cams[len(own):]))
    matrices[reader] = chain([with_identity(cam) for cam in cams[:len(own)]], 0) if rollout else cams[0]
    scores = read_cross(adapter, inputs, how, matrices)
    return scores, found.forward.indices, found.forward.logits, {"relevance_total": found.totals}


def _cross_partial_lrp(adapter: Adapter, inputs, target: Target, rule_set: RuleSet, how: ClassEntry, exact: bool) -> tuple:
    streams = adapter.streams(inputs)
    reader = coattention.readout_stream(streams)
    last = _last_sites(adapter, inputs)
    found = site_relevance(adapter, inputs, target, rule_set, exact, list(last.values()), "partial_lrp", gradients=False)
    matrices = {
        x: coattention.min_max(relevance.mean(1), coattention.real_pairs(reader, streams[x], relevance))
        for x, relevance in zip(last, found.relevances)
    }
    scores = read_cross(adapter, inputs, how, matrices)
    return scores, found.forward.indices, found.forward.logits, {"relevance_total": found.totals}
