"""Methods built on LRP relevance: transformer attribution (Chefer et al. CVPR'21), full LRP, partial LRP."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .capture import record_forward
from ..core.conventions import given_or
from ..families.base import Adapter, only_stream
from ..lrp import GRADIENT, PAPER, RELEVANCE, Session, relevance_session
from .gradients import carried_into
from .recompute import BlockRecompute, passes_down
from .targets import Target, resolve_target, target_score
from .attention import StartLayer, first_layer, readout_chain, readout_row, set_class_entry, with_identity
from .relevance import (
    conservation, entering, full_precision, masked, per_stream_result, recording_block_inputs, rule_set_for, unit_seed,
    stream_attentions, stream_depths,
)

WEIGHTS = ("gradient", "attention")
BLOCKS = ("all", "last", "first")
ATTRIBUTION_ROWS = 128  # rows of a block's attribution matrix made at once (`attribution_matrix`)


def one_of(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}; got '{value}'")


def transformer_attribution(
    adapter: Adapter, inputs: torch.Tensor, target: Target, start_layer: StartLayer = 0, weights: str = "gradient",
    blocks: str = "all", row_normalize: bool | None = None, cls_entry: str | None = None, exact: bool = False,
    checkpoint: bool = False,
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
    A stream fed by a model of its own (`Adapter.feeds`: a vision-language decoder's tower) has its readout row
    carried on into that model (`gradients.carried_into`) through that model's `I + E_h (G_l * R_l)^+`, `R_l` the
    relevance at its attention `l` from the same pass (through the projector) and `G_l` its gradient, every layer it
    is read after; `relevance_total` `(B,)` is then the relevance reaching the fed stream's own input tokens and the
    feeding model's input tokens (`start_layer` counts the fed stream's blocks only).
    `checkpoint`: one-stream models run each block again in the backward (`relevancy.methods.recompute`), so one block's
    rule graph is held at a time instead of every block's, for about one forward more; the same map.
    Models whose streams attend to each other (DETR, LXMERT): `across.transformer_attribution`.
    """
    one_of("weights", weights, WEIGHTS)
    one_of("blocks", blocks, BLOCKS)
    feeds = adapter.feeds(inputs)
    given = [name for name, value in (("checkpoint=True", checkpoint), (f"blocks={blocks!r}", blocks != "all"),
                                      ("row_normalize=True", bool(row_normalize))) if value]
    if feeds and given:
        raise ValueError(f"{', '.join(given)}: not offered where the relevance is carried on into a model that feeds a stream (a "
                         "vision tower), through every layer it is read after under the paper's unnormalised rule; explain without")
    if checkpoint:
        BlockRecompute.of(adapter, inputs)  # refused before any work where it does not apply
    conventions = adapter.conventions.transformer_attribution
    how = given_or(cls_entry, conventions.cls_entry)
    streams = adapter.streams(inputs)
    depths = stream_depths(adapter, streams)
    first = {}
    for name, stream in streams.items():
        start = first_layer(start_layer, stream, depths[name])
        first[name] = {"all": start, "last": depths[name] - 1, "first": 0}[blocks]
    fed_into = {feed.into for feed in feeds}
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        model = adapter32.model
        with relevance_session(model, adapter32.relevance_rule_map(), PAPER.with_exact(exact)) as session:
            used = {name: list(range(first[name], depths[name])) if blocks == "all" else [first[name]] for name in streams}
            if checkpoint:
                (start,) = first.values()
                fwd, matrices, arrived = attribution_block_by_block(adapter32, session, inputs32, target, start, used, weights)
            else:
                with recording_block_inputs(adapter32, session, streams):
                    fwd = record_forward(adapter32, inputs32, target, gradients=True)
                feeds = adapter32.feeds(inputs32)
                recorded = stream_attentions(adapter32, session, streams, feeds)
                flat = [recorded[name][index] for name in streams for index in used[name]]
                flat += [a for feed in feeds for a in recorded[feed.source.name][:max(feed.depths)]]
                seed = unit_seed(fwd.score)
                factors = session.backward(GRADIENT, fwd.score.sum(), flat, seed) if weights == "gradient" else [a.detach() for a in flat]
                # a fed stream's relevance is counted at its input, beside the feeding model's input
                tokens = [entering(session, name, 0 if name in fed_into else first[name]) for name in streams]
                tokens += [entering(session, feed.source.name, 0) for feed in feeds]
                matrices, arrived = combine_on_arrival(session, fwd.score.sum(), flat, seed, factors, tokens)
    normalize = given_or(row_normalize, conventions.row_normalize)
    label = "transformer_attribution"
    scores, totals, pending = {}, [], iter(matrices)
    for (name, stream), relevance in zip(streams.items(), arrived):
        stream_matrices = [next(pending) for _ in used[name]]
        if normalize:  # (I + M) / its row sums
            stream_matrices = [m.div_(m.sum(-1, keepdim=True)) for m in map(with_identity, stream_matrices)]
        chained = readout_chain(stream_matrices, stream, identity=not normalize, first_site=used[name][0])
        scores[name] = set_class_entry(chained, how, stream)
        where = label if len(streams) == 1 else f"{label} ({name} stream)"
        reached, sources = masked(stream, relevance), []
        for feed, source in zip(feeds, arrived[len(streams):]):
            if feed.into == name:  # the fed tokens' relevance counted where it arrives, at the feeding model's input
                reached = reached.masked_fill(feed.positions[..., None].to(relevance.device), 0)
                sources.append(source)
        # a source of several images per row (InternVL's tiles, `Feed.tiles`) holds each row's one after the other
        totals.append(conservation(torch.cat([r.reshape(len(reached), -1) for r in (reached, *sources)], 1), PAPER, where)["relevance_total"])
    for feed in feeds:
        scores[feed.source.name] = carried_into(feed, scores[feed.into], [next(pending) for _ in range(max(feed.depths))])
    return per_stream_result(scores, totals, fwd)


def combine_on_arrival(
    session, score: torch.Tensor, attentions: list[torch.Tensor], seed: torch.Tensor, factors: list, tokens: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Relevance pass: as each block's relevance `R_b` arrives, reduce it at once to `E_h (F_b * R_b)^+`.

    Keeps one `(B, T, T)` matrix per block instead of every `(B, heads, T, T)` relevance and factor. The pass
    goes on to `tokens` (per stream, the input of the earliest block used), whose relevances are returned too.
    """
    matrices: list = [None] * len(attentions)

    def reducer(index: int):
        def hook(relevance: torch.Tensor) -> None:
            matrices[index] = attribution_matrix(factors[index], relevance)
            factors[index] = None

        return hook

    handles = [a.register_hook(reducer(i)) for i, a in enumerate(attentions)]
    try:
        arrived = session.backward(RELEVANCE, score, tokens, seed)  # crosses every block used
    finally:
        for handle in handles:
            handle.remove()
    return matrices, arrived


def attribution_matrix(factor: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """One block's `E_h (F_b * R_b)^+` (the identity is added where the chain is read: `readout_chain`'s `identity`).
    On a CPU `ATTRIBUTION_ROWS` rows at a time: the same numbers, the temporaries one band's, in the cache (at 1,000
    tokens a quarter of the time of the whole `(B, heads, T, T)` product); a GPU takes the whole at once."""
    shape = torch.broadcast_shapes(factor.shape, relevance.shape)
    matrix = factor.new_empty(shape[:1] + shape[2:])
    step = ATTRIBUTION_ROWS if factor.device.type == "cpu" else shape[-2]
    for first in range(0, shape[-2], step):
        rows = slice(first, first + step)
        matrix[..., rows, :] = (factor[..., rows, :] * relevance[..., rows, :]).clamp_(min=0).mean(1)
    return matrix


def attribution_block_by_block(
    adapter: Adapter, session: Session, inputs, target: Target, first: int, used: dict[str, list[int]], weights: str
) -> tuple:
    """`transformer_attribution`'s passes with `checkpoint=True` (one stream): the forward keeps no block's graph,
    and the gradient and relevance passes cross one block run again at a time (`recompute.passes_down`), reduced
    to its matrix there. `(forward, the used blocks' matrices, [relevance at the input of block first])`."""
    recompute = BlockRecompute.of(adapter, inputs, forget=[session.attentions])
    with recompute.recording():
        fwd = record_forward(adapter, inputs, target, gradients=True)
    modes = (GRADIENT, RELEVANCE) if weights == "gradient" else (RELEVANCE,)
    (blocks,) = used.values()
    matrices: dict[int, torch.Tensor] = {}

    def reduce(index: int, attentions: list[torch.Tensor], found: dict[str, list[torch.Tensor]]) -> None:
        if index in blocks:
            (attention,) = attentions
            factor = found[GRADIENT][0] if weights == "gradient" else attention.detach()
            matrices[index] = attribution_matrix(factor, found[RELEVANCE][0])

    arrived = passes_down(recompute, first, fwd.score, modes, session.backward, session.attentions, reduce)
    return fwd, [matrices[index] for index in blocks], [arrived[RELEVANCE]]


def relevance_to(session: Session, score: torch.Tensor, leaf: torch.Tensor, recompute: BlockRecompute | None) -> torch.Tensor:
    """The relevance pass from `score` to `leaf` (the pixels, the token embeddings): at once, or with a
    `recompute` whose recording ran the forward, block by block (`checkpoint=True`)."""
    if recompute is None:
        return session.backward(RELEVANCE, score.sum(), [leaf], unit_seed(score))[0]
    below = passes_down(recompute, 0, score, (RELEVANCE,), session.backward, session.attentions)[RELEVANCE]
    return session.backward(RELEVANCE, recompute.calls[0].entered, [leaf], below)[0]


def partial_lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False
) -> tuple:
    """The paper's partial-LRP baseline: vanilla-rule relevance at the last attention, `E_h (R)^+` at the readout
    row, per stream (`relevance_total` as in `transformer_attribution`, at each stream's last block input).

    `rules`: see `relevance.rule_set_for` (BERT, DETR: "paper"); `cls_entry`: see `set_class_entry` (BERT: "zero"); `exact`: the
    authors' arithmetic.
    Models whose streams attend to each other (the authors' DETR `generate_partial_lrp`): `across.partial_lrp`.
    """
    rule_set = rule_set_for(rules, adapter.conventions.partial_lrp)
    how = given_or(cls_entry, adapter.conventions.partial_lrp.cls_entry)
    streams = adapter.streams(inputs)
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set.with_exact(exact), gradient_pass=False) as session:
            if len(streams) == 1 and adapter32.blocks:
                fwd, found = last_block_relevance(adapter32, session, inputs32, target)
            else:
                with recording_block_inputs(adapter32, session, streams):
                    fwd = record_forward(adapter32, inputs32, target, gradients=True)
                recorded = stream_attentions(adapter32, session, streams)
                lasts = [recorded[name][-1] for name in streams]
                tokens = [entering(session, name, -1) for name in streams]
                found = session.backward(RELEVANCE, fwd.score.sum(), lasts + tokens, unit_seed(fwd.score))
    scores, totals = {}, []
    for (name, stream), relevance, arrived in zip(streams.items(), found[:len(streams)], found[len(streams):]):
        scores[name] = set_class_entry(readout_row(relevance.clamp(min=0).mean(1), stream), how, stream)
        where = "partial_lrp" if len(streams) == 1 else f"partial_lrp ({name} stream)"
        totals.append(conservation(masked(stream, arrived), rule_set, where)["relevance_total"])
    return per_stream_result(scores, totals, fwd)


def last_block_relevance(adapter: Adapter, session: Session, inputs, target: Target) -> tuple:
    """One-stream `partial_lrp`: the forward keeps no block's rule graph and the relevance pass crosses the last
    block only, run again (`recompute`): `(forward, [relevance at its attention, at its input])`."""
    recompute = BlockRecompute.of(adapter, inputs, forget=[session.attentions], last_only=True)
    with recompute.recording():
        fwd = record_forward(adapter, inputs, target, gradients=True)
    at_attention: list[torch.Tensor] = []
    arrived = passes_down(recompute, len(adapter.blocks) - 1, fwd.score, (RELEVANCE,), session.backward, session.attentions,
                          lambda _index, _attentions, found: at_attention.append(found[RELEVANCE][0]))
    return fwd, [*at_attention, arrived[RELEVANCE]]


def lrp(
    adapter: Adapter, inputs: torch.Tensor, target: Target, rules: str | None = None, cls_entry: str | None = None, exact: bool = False,
    checkpoint: bool = False,
) -> tuple:
    """The paper's full-LRP baseline: vanilla rules down to the pixels (z^B at the patch embedding), `(B, H, W)`.

    Text models: relevance at the embedding output summed over the hidden dimension, `(B, T)` (the BERT
    reference's `generate_full_lrp`). `rules`: see `relevance.rule_set_for` (BERT: "paper"); `cls_entry`: see
    `set_class_entry` (BERT: "zero"); `exact`: the authors' arithmetic. `checkpoint`: each block run again in the
    backward, one block's rule graph held at a time (see `transformer_attribution`).
    """
    rule_set = rule_set_for(rules, adapter.conventions.lrp)
    stream = only_stream(adapter, inputs, "lrp")
    with full_precision(adapter, inputs) as (adapter32, inputs32):
        with relevance_session(adapter32.model, adapter32.relevance_rule_map(), rule_set.with_exact(exact), gradient_pass=False) as session:
            recompute = BlockRecompute.of(adapter32, inputs32, forget=[session.attentions]) if checkpoint else None
            recording = recompute.recording() if recompute else nullcontext()
            if stream.kind == "image":
                pixels = inputs32.detach().requires_grad_(True)
                with recording:
                    fwd = record_forward(adapter32, pixels, target, gradients=True)
                scores = relevance_to(session, fwd.score, pixels, recompute).sum(1)
                return scores, fwd.indices, fwd.logits, conservation(scores, rule_set, "lrp")
            with torch.enable_grad(), recording:
                tokens = adapter32.embed(inputs32)[stream.name].detach().requires_grad_(True)
                logits, pre_logits = adapter32.forward_tokens(inputs32, {stream.name: tokens})
                indices = resolve_target(target, logits)
                score = target_score(target, indices, logits, pre_logits, graph=True)
            relevance = relevance_to(session, score, tokens, recompute)
    scores = masked(stream, relevance).sum(-1)
    details = conservation(scores, rule_set, "lrp")
    return set_class_entry(scores, given_or(cls_entry, adapter.conventions.lrp.cls_entry), stream), indices, logits.detach(), details
