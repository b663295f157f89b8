"""The methods on models whose streams attend to each other (LXMERT, DETR): every map is read at the one readout
stream's row, through the readout stream's attention into each stream (the authors' co-attention code).

Each function takes the same options as its self-attention counterpart (the registry's `Method.across`), so that
`explain` picks the strategy once from the adapter's attention sites (`Method.runner`) and no method branches on
it; options that only apply to self-attention models are refused here by name.
"""
from __future__ import annotations

from typing import Any

import torch

from .capture import record_forward
from ..core.conventions import ClassEntry, Region, check_choice, given_or
from ..families.base import Adapter
from ..lrp import PAPER, RuleSet
from .recompute import checkpoint_refused
from .targets import Target
from . import coattention
from .attention import StartLayer, chain, read_cross, with_identity
from .gradients import check_generic_weights
from .propagation import BLOCKS, WEIGHTS, one_of
from .relevance import rule_set_for, site_relevance


def raw_attention(adapter: Adapter, inputs: Any, target: Target, cls_entry: str | None = None) -> tuple:
    """The readout stream's last self-attention, and its last cross-attention into each other stream."""
    fwd = record_forward(adapter, inputs, target, attentions=True, share_rows=True)
    last = _last_sites(adapter, inputs)
    matrices = {x: fwd.attentions[k].mean(1) for x, k in last.items()}
    how = given_or(cls_entry, adapter.conventions.raw_attention.cls_entry)
    return read_cross(adapter, inputs, how, matrices), fwd.indices, fwd.logits


def rollout(
    adapter: Adapter, inputs: Any, target: Target, start_layer: int = 0, cls_entry: str | None = None,
    row_normalize: bool | None = None,
) -> tuple:
    """Rollout across streams (`coattention.rollout_matrices`), every layer."""
    if start_layer != 0:
        raise ValueError("start_layer applies to self-attention models; rollout across streams uses every layer")
    conventions = adapter.conventions.rollout
    fwd = record_forward(adapter, inputs, target, attentions=True, share_rows=True)
    streams = adapter.streams(inputs)
    reader = coattention.readout_stream(streams).name
    matrices = coattention.rollout_matrices(
        fwd.sites, fwd.attentions, streams, reader, given_or(row_normalize, conventions.row_normalize)
    )
    return read_cross(adapter, inputs, given_or(cls_entry, conventions.cls_entry), matrices), fwd.indices, fwd.logits


def attention_gradcam(
    adapter: Adapter, inputs: Any, target: Target, normalize: bool | None = None, region: str | None = None,
    cls_entry: str | None = None,
) -> tuple:
    """Grad-CAM on the readout stream's last self-attention and its last cross-attention into each other stream,
    heads weighted by their mean gradient over the real (query, key) pairs, head mean, then ReLU; `normalize`:
    min-max over each whole matrix."""
    conventions = adapter.conventions.attention_gradcam
    check_choice("region", given_or(region, conventions.region), Region)
    normalize = given_or(normalize, conventions.normalize)
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=True)
    streams = adapter.streams(inputs)
    reader = coattention.readout_stream(streams)
    last = coattention.last_sites(fwd.sites, reader.name, streams)
    grads = dict(zip(last, fwd.gradients([fwd.attentions[k] for k in last.values()])))
    matrices = {}
    for x, k in last.items():
        attention = fwd.attentions[k].detach()
        pairs = coattention.real_pairs(reader, streams[x], attention)
        weights = (grads[x] * pairs[:, None]).sum((-2, -1), keepdim=True) / pairs[:, None].sum((-2, -1), keepdim=True)
        cam = (attention * weights).mean(1).clamp(min=0)
        matrices[x] = coattention.min_max(cam, pairs) if normalize else cam
    how = given_or(cls_entry, conventions.cls_entry)
    return read_cross(adapter, inputs, how, matrices), fwd.indices, fwd.logits


def generic_attention(
    adapter: Adapter, inputs: Any, target: Target, start_layer: StartLayer = None, cls_entry: str | None = None,
    residual_normalization: bool | None = None, bimodal_self_terms: bool | None = None, aggregate: bool | None = None,
    weights: str = "attention", exact: bool = False, checkpoint: bool = False,
) -> tuple:
    """The co-attention rules of `coattention.propagate` at every site (the paper's ablations default to on),
    read at the readout row. `checkpoint` is refused: it runs the blocks of one-stream models."""
    check_generic_weights(weights, exact)
    if checkpoint:
        raise checkpoint_refused(adapter)
    if start_layer is not None:
        raise ValueError("start_layer applies to self-attention models; the co-attention rules use every layer")
    rules = {"residual_normalization": residual_normalization, "bimodal_self_terms": bimodal_self_terms, "aggregate": aggregate}
    streams = adapter.streams(inputs)
    reader = coattention.readout_stream(streams).name
    sites = adapter.attention_sites()
    details = ()
    if weights == "relevance":
        found = site_relevance(adapter, inputs, target, PAPER, exact, list(range(len(sites))), "generic_attention")
        fwd, attentions = found.forward, found.attentions
        cams = coattention.gradient_weighted(found.gradients, found.relevances)
        details = ({"relevance_total": found.totals},)
    else:
        fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=True)
        attentions = fwd.attentions
        cams = fwd.gradients(attentions, combine=coattention.weighted_in_place)
    sizes = coattention.sizes_of(sites, attentions)
    relevance = coattention.propagate(sites, cams, streams, sizes, **{k: v is not False for k, v in rules.items()})
    how = given_or(cls_entry, adapter.conventions.generic_attention.cls_entry)
    scores = read_cross(adapter, inputs, how, {x: relevance[reader, x] for x in streams})
    return (scores, fwd.indices, fwd.logits, *details)


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: StartLayer = 0, weights: str = "gradient",
    blocks: str = "all", row_normalize: bool | None = None, cls_entry: str | None = None, exact: bool = False,
    checkpoint: bool = False,
) -> tuple:
    """The authors' `generate_transformer_att`: `E_h (G * R)^+` of the readout stream's last attention into each
    stream, read at the readout row; where the family's convention `readout_rollout` is set (LXMERT), the readout
    stream's own map is the rollout `prod (I + E_h (G * R)^+)` over all of its self-attentions.
    `relevance_total` `(B, streams)`: the relevance reaching each stream's input. `checkpoint` is refused (see
    `generic_attention`)."""
    one_of("weights", weights, WEIGHTS)
    one_of("blocks", blocks, BLOCKS)
    if checkpoint:
        raise checkpoint_refused(adapter)
    given = {"start_layer": start_layer != 0, "blocks": blocks != "all", "row_normalize": row_normalize is not None}
    if any(given.values()):
        raise ValueError(
            f"{', '.join(n for n, g in given.items() if g)} apply to self-attention models; on models whose streams "
            "attend to each other transformer_attribution reads the last attention into each stream"
        )
    conventions = adapter.conventions.transformer_attribution
    reader = coattention.readout_stream(adapter.streams(inputs)).name
    last = _last_sites(adapter, inputs)
    rollout = conventions.readout_rollout
    own = [k for k, site in enumerate(adapter.attention_sites()) if site.is_self and site.query == reader] if rollout else [last[reader]]
    others = [x for x in last if x != reader]
    found = site_relevance(adapter, inputs, target, PAPER, exact, own + [last[x] for x in others], "transformer_attribution",
                           gradients=weights == "gradient")
    factors = found.gradients if weights == "gradient" else found.attentions
    cams = coattention.gradient_weighted(factors, found.relevances)
    matrices = dict(zip(others, cams[len(own):]))
    matrices[reader] = chain([with_identity(cam) for cam in cams[:len(own)]], 0) if rollout else cams[0]
    scores = read_cross(adapter, inputs, given_or(cls_entry, conventions.cls_entry), matrices)
    return scores, found.forward.indices, found.forward.logits, {"relevance_total": found.totals}


def partial_lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The authors' DETR `generate_partial_lrp`: the head mean of the relevance at the readout stream's last
    attention into each stream, unclamped, min-max normalised over the whole matrix (every query, real tokens),
    read at the readout row; `relevance_total` as in `transformer_attribution`."""
    conventions = adapter.conventions.partial_lrp
    rule_set: RuleSet = rule_set_for(rules, conventions)
    how: ClassEntry = given_or(cls_entry, conventions.cls_entry)
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


def _last_sites(adapter: Adapter, inputs) -> dict[str, int]:
    """Per stream, the readout stream's last attention into it."""
    streams = adapter.streams(inputs)
    return coattention.last_sites(adapter.attention_sites(), coattention.readout_stream(streams).name, streams)
