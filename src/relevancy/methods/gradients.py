"""Methods that weight attention or tokens by gradients of the explained score."""
from __future__ import annotations

from typing import Any

import torch

from .capture import record_forward
from ..core.conventions import Region, check_choice, given_or
from ..families.base import Adapter, forward_hooks
from .recompute import BlockRecompute, gradient_pass, passes_down
from ..core.streams import Feed, Stream
from .targets import Target
from . import coattention
from .attention import StartLayer, first_layer, on_grid, per_stream, readout_chain, readout_row, site_row

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
    Cross-attention models: `across.attention_gradcam`.
    """
    conventions = adapter.conventions.attention_gradcam
    normalize = given_or(normalize, conventions.normalize)
    region = check_choice("region", given_or(region, conventions.region), Region)
    how = given_or(cls_entry, conventions.cls_entry)
    streams = adapter.streams(inputs)
    windowed = [name for name, stream in streams.items() if stream.layout is not None]
    if region == "matrix" and windowed:
        raise ValueError(f"region='matrix' reads the whole attention matrix; the {adapter.family} family's attention is "
                         "windowed (its matrix is block-sparse): use region='class_row'")
    fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=True, last_block_graph=True,
                         last_attention_only=True)
    lasts = [fwd.self_attentions(name)[-1] for name in streams]
    grads = dict(zip(streams, fwd.gradients(lasts)))
    attention_of = dict(zip(streams, lasts))

    def compute(stream: Stream) -> torch.Tensor:
        attention, grad = attention_of[stream.name].detach(), grads[stream.name]
        if region == "class_row":  # pooled: the pooled token's row, over the entries the (windowed) attention has
            cam = site_row(attention, stream)  # (B, H, T)
            weights = site_row(grad, stream)[..., stream.prefix_tokens:].mean(-1, keepdim=True)
            scores = on_grid((weights * cam).mean(1).clamp(min=0), stream)
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


def check_generic_weights(weights: str, exact: bool) -> None:
    """generic_attention's `weights` is one of GENERIC_WEIGHTS, and `exact` comes with relevance weights only."""
    if weights not in GENERIC_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(GENERIC_WEIGHTS)}; got '{weights}'")
    if exact and weights != "relevance":
        raise ValueError("exact applies to weights='relevance' only (the LRP arithmetic); weights='attention' computes no relevance")


def generic_attention(
    adapter: Adapter, inputs: Any, target: Target, start_layer: StartLayer = None, cls_entry: str | None = None,
    residual_normalization: bool | None = None, bimodal_self_terms: bool | None = None, aggregate: bool | None = None,
    weights: str = "attention", exact: bool = False, checkpoint: bool = False,
) -> tuple:
    """Chefer et al. ICCV'21 self-attention rule, per stream: `R = I; R += E_h (G * A)^+ @ R` from `start_layer` on;
    on models whose streams attend to each other (LXMERT, DETR), the co-attention rules (`across.generic_attention`).

    `start_layer`: the first block used (negative: from the end, -1 = the last block only; a dict: one per stream);
    the family's default when None (ViT, BERT: 0, every block; CLIP: -1, the authors' notebook).
    `cls_entry`: see `set_class_entry` (text models: "zero", as the BERT rollout reference; its value holds the identity).
    `residual_normalization`, `bimodal_self_terms`, `aggregate` (cross-attention models, default True): the paper's
    ablations, see `coattention.propagate`.
    `weights` (cross-attention models with relevance rules: DETR, LXMERT): what multiplies the gradient, the attention
    "attention" (the paper's method) or its LRP relevance "relevance" (`E_h (G * R_A)^+`, the authors' DETR and
    LXMERT `use_lrp=True`; `R_A` as in `partial_lrp`, paper rules); `exact`: the authors' LRP arithmetic (see
    relevancy.lrp.rules). On self-attention models the LRP-weighted rule is `transformer_attribution`.
    `checkpoint` (one-stream models): each block run again in the backward (`relevancy.methods.recompute`), so that one
    block's activations are held at a time, for about one forward more; the same map.
    A stream fed by a model of its own (`Adapter.feeds`: a vision-language decoder's tower) has its readout row
    carried on into that model (`carried_into`), every layer it reads, gradients from the same backward.
    """
    check_generic_weights(weights, exact)
    conventions = adapter.conventions.generic_attention
    how = given_or(cls_entry, conventions.cls_entry)
    cross = dict(residual_normalization=residual_normalization, bimodal_self_terms=bimodal_self_terms, aggregate=aggregate)
    if weights != "attention":
        raise ValueError(
            "weights='relevance' applies to models whose streams attend to each other (DETR, LXMERT); on self-attention models "
            "the LRP-weighted rule is method='transformer_attribution'"
        )
    coattention.cross_options_error(cross)
    start_layer = given_or(start_layer, conventions.start_layer)
    feeds = adapter.feeds(inputs)
    if checkpoint and feeds:
        raise ValueError("checkpoint=True runs generic_attention block by block on one stream; this model's stream is fed by a "
                         "model of its own (a vision tower) whose relevance it carries on: explain without checkpoint")
    if checkpoint:
        return generic_attention_block_by_block(adapter, inputs, target, start_layer, how)
    fed_sites = [site for feed in feeds for site in feed.sites[:max(feed.depths)]]
    fed: list[torch.Tensor | None] = [None] * len(fed_sites)

    def keep(index: int, probabilities: torch.Tensor) -> None:
        fed[index] = probabilities

    with forward_hooks([site.probabilities for site in fed_sites], keep):
        fwd = record_forward(adapter, inputs, target, attentions=True, gradients=True, share_rows=not feeds)
    streams = adapter.streams(inputs)
    used = {}
    for name, stream in streams.items():
        attentions = fwd.self_attentions(name)
        used[name] = attentions[first_layer(start_layer, stream, len(attentions)):]
    flat = [a for name in streams for a in used[name]]
    # R = prod_l (I + E_h (G_l * A_l)^+), read at the readout row (carried back through the blocks: no (T, T) product);
    # each block's E_h (G_l * A_l)^+ is taken as the backward reaches it, so no two full gradients are held at once
    roots = [used[name][0] for name in streams] + fed[:1]
    cams = iter(fwd.reduced_gradients(flat + fed, coattention.weighted_head_mean, roots))
    updates = {name: [next(cams) for _ in attentions] for name, attentions in used.items()}
    scores = per_stream(adapter, inputs, how, lambda stream: readout_chain(updates[stream.name], stream, identity=True))
    for feed in feeds:
        scores[feed.source.name] = carried_into(feed, scores[feed.into], [next(cams) for _ in range(max(feed.depths))])
    return scores, fwd.indices, fwd.logits


def carried_into(feed: Feed, row: torch.Tensor, updates: list[torch.Tensor]) -> torch.Tensor:
    """The readout row `row` `(B, T)` of the stream a `Feed` feeds, carried on into the feeding stream (the ICCV'21
    self-attention rule there, as for CLIP's towers): its entries at the fed tokens shared among the source tokens
    each is made from (`feed.weights`), then back through the source's blocks `R = prod_l (I + E_h (G_l * A_l)^+)`
    (`updates`: each block's `E_h (G_l * A_l)^+`, first to last). Read at several depths, the relevance enters at
    each: at the deepest, and again at each shallower one on its own path down, `v R_deep + v R_shallow` (the fed
    token is made of both sides by side). `(B, N)` over the source's content tokens (`(B, tiles * N)`: each tile's
    after the other, where each row's source is several images, `feed.tiles`)."""
    entering = row[feed.positions.to(row.device)].view(len(row) * feed.tiles, -1) @ feed.weights.to(row)
    carried = torch.zeros_like(entering)
    for depth in range(max(feed.depths), 0, -1):
        if depth in feed.depths:
            carried = carried + entering
        carried = carried + torch.bmm(carried.unsqueeze(1), updates[depth - 1]).squeeze(1)
    if 0 in feed.depths:
        carried = carried + entering
    return carried[:, feed.source.prefix_tokens:].reshape(len(row), -1)


def generic_attention_block_by_block(adapter: Adapter, inputs: Any, target: Target, start_layer: StartLayer, how) -> tuple:
    """`generic_attention` with `checkpoint=True`: the forward keeps no block's activations; the gradient pass
    crosses one block run again at a time, reduced to that block's `E_h (G * A)^+` there."""
    recompute = BlockRecompute.of(adapter, inputs)
    (stream,) = adapter.streams(inputs).values()
    with recompute.recording():
        fwd = record_forward(adapter, inputs, target, gradients=True)
    first = first_layer(start_layer, stream, len(adapter.blocks))
    made: list[torch.Tensor] = []
    cams: dict[int, torch.Tensor] = {}

    def keep(_index: int, probabilities: torch.Tensor) -> None:
        if recompute.rerunning:
            made.append(probabilities)

    def reduce(index: int, attentions: list[torch.Tensor], found: dict[str, list[torch.Tensor]]) -> None:
        (attention,) = attentions
        cams[index] = coattention.weighted_head_mean(found["gradient"][0], attention.detach())

    with forward_hooks([site.probabilities for site in adapter.attention_sites()], keep):
        passes_down(recompute, first, fwd.score, ("gradient",), gradient_pass, made, reduce)
    updates = [cams[index] for index in range(first, len(adapter.blocks))]
    scores = per_stream(adapter, inputs, how, lambda s: readout_chain(updates, s, identity=True))
    return scores, fwd.indices, fwd.logits


def gradcam(adapter: Adapter, inputs: Any, target: Target, normalize: bool = False) -> tuple:
    """Grad-CAM (Selvaraju et al.) where pytorch-grad-cam's transformer recipe puts it: the normalised tokens entering
    each stream's last attention (timm ViT's `blocks[-1].norm1`, Swin's last block's `norm1`), [CLS] left out. Each
    channel is weighted by the mean of the score's gradient over the content tokens; the map is the ReLU of the
    weighted sum over channels. `normalize`: min-max per map, as pytorch-grad-cam shows it (its `1e-7` added to the
    maximum); the order of the tokens, and so every perturbation and segmentation figure, is the same either way."""
    fwd = record_forward(adapter, inputs, target, attention_inputs=True, gradients=True, share_rows=True, last_block_graph=True)
    streams = adapter.streams(inputs)
    tokens = [fwd.attention_inputs[name] for name in streams]
    grads = fwd.gradients(tokens)
    scores = {}
    for (name, stream), x, g in zip(streams.items(), tokens, grads):
        x, g = x.detach().flatten(1, -2), g.flatten(1, -2)  # a grid of tokens (Swin's (B, h, w, C)) flattened
        weights = g[:, stream.prefix_tokens:].mean(1, keepdim=True)
        cam = on_grid((x * weights).sum(-1).clamp(min=0), stream)
        if normalize:
            cam = cam - cam.amin(-1, keepdim=True)
            cam = cam / (cam.amax(-1, keepdim=True) + 1e-7)
        scores[name] = cam
    return scores, fwd.indices, fwd.logits


def cdam(adapter: Adapter, inputs: Any, target: Target) -> tuple:
    """Brocki & Chung: `sum_d X * dF/dX` at the normalised tokens entering each stream's last attention; signed."""
    fwd = record_forward(adapter, inputs, target, attention_inputs=True, gradients=True, share_rows=True, last_block_graph=True)
    streams = adapter.streams(inputs)
    tokens = [fwd.attention_inputs[name] for name in streams]
    grads = fwd.gradients(tokens)
    scores = {
        name: on_grid((x.detach() * g).sum(-1).flatten(1), stream)  # a grid of tokens (Swin's (B, h, w, C)) flattened
        for (name, stream), x, g in zip(streams.items(), tokens, grads)
    }
    return scores, fwd.indices, fwd.logits
