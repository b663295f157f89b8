"""Methods that weight attention or tokens by gradients of the explained score."""
from __future__ import annotations

from typing import Any

import torch

from ..capture import record_forward
from ..families.base import Adapter
from ..streams import Stream
from ..targets import Target
from . import coattention
from ..conventions import ClassEntry, Region, check_choice, given_or
from .attention import StartLayer, first_layer, per_stream, read_cross, readout_row
from .propagation import PAPER, site_relevance

def attention_gradcam(
    adapter: Adapter, inputs: Any, target: Target, normalize: bool | None = None, region: str | None = None,
    cls_entry: str | None = None,
) -> tuple:
    """Grad-CAM on the last attention: heads weighted by their mean gradient, then ReLU.

    `normalize=True` min-max normalises each map, as the authors' baseline code does; a constant map (the
    ReLU left nothing) becomes zeros where the reference divides 0 by 0.
    `region`: where the gradient is averaged and the min-max taken: "class_row" (the readout row at the content
    columns, the ViT reference) or "matrix" (the whole attention matrix over the real tokens, the BERT reference).
    `cls_entry`: see `set_class_entry`, applied after the normalisation (the BERT reference: "zero").
    """
    conventions = adapter.conventions.attention_gradcam
    normalize = given_or(normalize, conventions.normalize)
    region = check_choice("region", given_or(region, conventions.region), Region)
    how = given_or(cls_entry, conventions.cls_entry)
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=True)
    if coattention.has_cross_attention(adapter):
        return _cross_gradcam(adapter, inputs, fwd, normalize, how), fwd.indices, fwd.logits
    streams = adapter.streams(inputs)
    lasts = [fwd.self_attentions(name)[-1] for name in streams]
    grads = dict(zip(streams, fwd.gradients(lasts)))
    attention_of = dict(zip(streams, lasts))

    def compute(stream: Stream) -> torch.Tensor:
        attention, grad = attention_of[stream.name].detach(), grads[stream.name]
        if region == "class_row":
            cam = readout_row(attention, stream)  # (B, H, N)
            weights = readout_row(grad, stream).mean(-1, keepdim=True)
            scores = (weights * cam).mean(1).clamp(min=0)
            low, high = scores.amin(-1, keepdim=True), scores.amax(-1, keepdim=True)
        else:
            valid = stream.valid
            if valid is None:
                valid = torch.ones(attention.shape[0], attention.shape[-1], dtype=torch.bool, device=attention.device)
            pairs = (valid[:, :, None] & valid[:, None, :])[:, None]  # (B, 1, T, T)
            weights = (grad * pairs).sum((-2, -1), keepdim=True) / pairs.sum((-2, -1), keepdim=True)
            maps = (attention * weights).mean(1).clamp(min=0)  # (B, T, T)
            scores = readout_row(maps, stream)
            low = maps.masked_fill(~pairs[:, 0], float("inf")).amin((-2, -1))[:, None]
            high = maps.masked_fill(~pairs[:, 0], float("-inf")).amax((-2, -1))[:, None]
        if normalize:
            span = high - low
            scores = (scores - low) / torch.where(span > 0, span, torch.ones_like(span))
        return scores

    return per_stream(adapter, inputs, how, compute), fwd.indices, fwd.logits


GENERIC_WEIGHTS = ("attention", "relevance")


def generic_attention(
    adapter: Adapter, inputs: Any, target: Target, start_layer: StartLayer = None, cls_entry: str | None = None,
    residual_normalization: bool | None = None, bimodal_self_terms: bool | None = None, aggregate: bool | None = None,
    weights: str = "attention", exact: bool = False,
) -> tuple:
    """Chefer et al. ICCV'21 self-attention rule, per stream: `R = I; R += E_h (G * A)^+ @ R` from `start_layer` on;
    on models whose streams attend to each other (LXMERT, DETR), the co-attention rules of `methods.coattention`.

    `start_layer`: the first block used (negative: from the end, -1 = the last block only; a dict: one per stream);
    the family's default when None (ViT, BERT: 0, every block; CLIP: -1, the authors' notebook).
    `cls_entry`: see `set_class_entry` (text models: "zero", as the BERT rollout reference; its value holds the identity).
    `residual_normalization`, `bimodal_self_terms`, `aggregate` (cross-attention models, default True): the paper's
    ablations, see `coattention.propagate`.
    `weights` (cross-attention models with relevance rules: DETR, LXMERT): what multiplies the gradient, the attention
    "attention" (the paper's method) or its LRP relevance "relevance" (`E_h (G * R_A)^+`, the authors' DETR and
    LXMERT `use_lrp=True`; `R_A` as in `partial_lrp`, paper rules); `exact`: the authors' LRP arithmetic (see
    relevancy.lrp.rules). On self-attention models the LRP-weighted rule is `transformer_attribution`.
    """
    if weights not in GENERIC_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(GENERIC_WEIGHTS)}; got '{weights}'")
    if exact and weights != "relevance":
        raise ValueError("exact applies to weights='relevance' only (the LRP arithmetic); weights='attention' computes no relevance")
    conventions = adapter.conventions.generic_attention
    how = given_or(cls_entry, conventions.cls_entry)
    cross = dict(residual_normalization=residual_normalization, bimodal_self_terms=bimodal_self_terms, aggregate=aggregate)
    if coattention.has_cross_attention(adapter):
        if start_layer is not None:
            raise ValueError("start_layer applies to self-attention models; the co-attention rules use every layer")
        return _co_attention(adapter, inputs, target, how, weights, exact, **{k: v is not False for k, v in cross.items()})
    if weights != "attention":
        raise ValueError(
            "weights='relevance' applies to models whose streams attend to each other (DETR, LXMERT); on self-attention models "
            "the LRP-weighted rule is method='transformer_attribution'"
        )
    coattention.cross_options_error(cross)
    start_layer = given_or(start_layer, conventions.start_layer)
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=True)
    streams = adapter.streams(inputs)
    used = {}
    for name, stream in streams.items():
        attentions = fwd.self_attentions(name)
        used[name] = attentions[first_layer(start_layer, stream, len(attentions)):]
    flat = [a for name in streams for a in used[name]]
    grads = iter(fwd.gradients(flat))

    relevance: dict[str, torch.Tensor] = {}
    for name, attentions in used.items():
        tokens = attentions[0].shape[-1]
        matrix = torch.eye(tokens, dtype=attentions[0].dtype, device=attentions[0].device).expand(len(attentions[0]), tokens, tokens)
        for attention in attentions:
            matrix = matrix + (next(grads) * attention.detach()).clamp(min=0).mean(1) @ matrix
        relevance[name] = matrix
    scores = per_stream(adapter, inputs, how, lambda stream: readout_row(relevance[stream.name], stream))
    return scores, fwd.indices, fwd.logits


def cdam(adapter: Adapter, inputs: Any, target: Target) -> tuple:
    """Brocki & Chung: `sum_d X * dF/dX` at the normalised tokens entering each stream's last attention; signed."""
    fwd = record_forward(adapter, inputs, target, attention_inputs=True, gradients=True, share_rows=True)
    streams = adapter.streams(inputs)
    tokens = [fwd.attention_inputs[name] for name in streams]
    grads = fwd.gradients(tokens)
    scores = {
        name: (x.detach() * g).sum(-1)[:, stream.prefix_tokens:]
        for (name, stream), x, g in zip(streams.items(), tokens, grads)
    }
    return scores, fwd.indices, fwd.logits


def _co_attention(
    adapter: Adapter, inputs: Any, target: Target, how: ClassEntry, weights: str, exact: bool, **rules: bool
) -> tuple:
    """generic_attention on a model with cross-attention: every site's rule, read at the readout row."""
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
    relevance = coattention.propagate(sites, cams, streams, sizes, **rules)
    scores = read_cross(adapter, inputs, how, {x: relevance[reader, x] for x in streams})
    return (scores, fwd.indices, fwd.logits, *details)


def _cross_gradcam(adapter: Adapter, inputs: Any, fwd, normalize: bool, how: ClassEntry) -> dict[str, torch.Tensor]:
    """Grad-CAM on a cross-attention model: on the readout stream's last self-attention and its last
    cross-attention into each other stream, heads weighted by their mean gradient over the real (query, key)
    pairs, head mean, then ReLU; `normalize`: min-max over each whole matrix."""
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
    return read_cross(adapter, inputs, how, matrices)
