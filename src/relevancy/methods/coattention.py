"""The ICCV'21 rules for models whose streams attend to each other: co-attention (LXMERT) and encoder-decoder
(DETR) transformers.

Relevance is a matrix `R[s, x]` for every pair of streams (`(B, T_s, T_x)`): how much each token of stream `x`
contributes to each token of stream `s`. It starts at `R[s, s] = I`, `R[s, x] = 0`, and the model's attention
sites update it in forward order, with `Ā = mean_h (G * A)^+` (rule 5: clamp after the product, before the head
mean):

* a self-attention of stream `s` (rules 6-7): `R[s, x] += Ā @ R[s, x]` for every stream `x`;
* a cross-attention, queries of `s`, keys of `k` (rules 10-11):
  `R[s, k] += norm(R[s, s])^T @ Ā @ norm(R[k, k])` and, when `k` also attends to `s` (co-attention; otherwise
  `R[k, s]` stays 0), `R[s, s] += Ā @ R[k, s]`. `norm(R) = (R - I) / rowsum(R - I) + I` (eqs. 8-9). A row of
  `R - I` that is all zero makes the product NaN; then the whole term is dropped (`add[isnan(add)] = 0`), as the
  authors' DETR code does.

Sites sharing an `AttentionSite.group` (LXMERT's two cross attentions of a layer) are all computed from the
matrices as they stood before the group. The map is the readout row of `R[r, x]` for the one stream `r` with a
readout (LXMERT: text [CLS]; DETR: the explained query).

The baselines of the paper's tables read the same sites: raw attention and Grad-CAM on the readout stream's last
self-attention and last cross-attention into each other stream, rollout through each stream's self-attentions.
"""
from __future__ import annotations

from typing import Any

import torch

from ..families.base import UnsupportedModelError
from ..core.streams import AttentionSite, Stream

Matrices = dict[tuple[str, str], torch.Tensor]


def readout_stream(streams: dict[str, Stream]) -> Stream:
    """The one stream whose readout row the maps of a cross-attention model are read from."""
    reading = [stream for stream in streams.values() if stream.readout is not None]
    if len(reading) != 1:
        raise UnsupportedModelError(
            f"a model whose streams attend to each other needs exactly one stream with a readout token, got "
            f"{', '.join(s.name for s in reading) or 'none'} among {', '.join(streams)}"
        )
    return reading[0]


def steps(sites: list[AttentionSite]) -> list[list[int]]:
    """Site indices grouped into steps: consecutive sites sharing a group number form one step."""
    grouped: list[list[int]] = []
    for k, site in enumerate(sites):
        if grouped and site.group is not None and sites[grouped[-1][0]].group == site.group:
            grouped[-1].append(k)
        else:
            grouped.append([k])
    return grouped


def _identity(batch: int, tokens: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(tokens, dtype=like.dtype, device=like.device).expand(batch, tokens, tokens)


def initial_matrices(streams: dict[str, Stream], sizes: dict[str, int], like: torch.Tensor) -> Matrices:
    """`R[s, s] = I`, `R[s, x] = 0`."""
    batch = len(like)
    return {
        (s, x): _identity(batch, sizes[s], like) if s == x
        else torch.zeros(batch, sizes[s], sizes[x], dtype=like.dtype, device=like.device)
        for s in streams for x in streams
    }


def residual_normalised(matrix: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`(R - I) / rowsum(R - I) + I` (the paper's eqs. 8-9); padding rows (`valid` False) stay the identity's."""
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    residual = matrix - eye
    if valid is not None:
        residual = residual * valid[..., None]
        sums = residual.sum(-1, keepdim=True)
        sums = torch.where(valid[..., None], sums, torch.ones_like(sums))
    else:
        sums = residual.sum(-1, keepdim=True)
    return residual / sums + eye


def sizes_of(sites: list[AttentionSite], attentions: list[torch.Tensor]) -> dict[str, int]:
    """Tokens per stream, read off the recorded attentions."""
    sizes: dict[str, int] = {}
    for site, attention in zip(sites, attentions):
        sizes[site.query], sizes[site.key] = attention.shape[-2], attention.shape[-1]
    return sizes


def propagate(
    sites: list[AttentionSite],
    cams: list[torch.Tensor],
    streams: dict[str, Stream],
    sizes: dict[str, int],
    *,
    residual_normalization: bool = True,
    bimodal_self_terms: bool = True,
    aggregate: bool = True,
) -> Matrices:
    """Apply every site's rule to the relevance matrices (see the module docstring); `cams` are the `Ā` per site.

    `residual_normalization=False`: rule 10 with `R[s, s]`, `R[k, k]` as they are; `bimodal_self_terms=False`:
    rule 10 adds `Ā` alone; `aggregate=False`: every update replaces its matrix instead of adding to it (the
    paper's ablations).
    """
    relevance = initial_matrices(streams, sizes, cams[0])
    untouched = set(relevance)  # still I or 0: a product with them needs no matrix multiplication
    attends = {(site.query, site.key) for site in sites}
    valid = {name: stream.valid for name, stream in streams.items()}
    for step in steps(sites):
        updates: list[tuple[tuple[str, str], torch.Tensor]] = []
        for k in step:
            site, cam = sites[k], cams[k]
            s, key = site.query, site.key
            if site.is_self:
                for x in streams:
                    if (s, x) not in untouched:
                        updates.append(((s, x), cam @ relevance[s, x]))
                    elif s == x:
                        updates.append(((s, x), cam))  # Ā @ I
                    # Ā @ 0 leaves the zero matrix as it is
                continue
            if bimodal_self_terms:
                left, right = relevance[s, s], relevance[key, key]
                if residual_normalization:
                    left, right = residual_normalised(left, valid[s]), residual_normalised(right, valid[key])
                add = left.transpose(-1, -2) @ (cam @ right)
                add = torch.where(torch.isnan(add), torch.zeros_like(add), add)
            else:
                add = cam
            updates.append(((s, key), add))
            if (key, s) in attends:
                updates.append(((s, s), cam @ relevance[key, s]))
        for pair, value in updates:
            relevance[pair] = relevance[pair] + value if aggregate else value
            untouched.discard(pair)
    return relevance


def weighted_head_mean(gradient: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`mean_h (G * W)^+` of one attention (rule 5), `(B, T_query, T_key)`; neither input is written."""
    return (gradient * weights).clamp_(min=0).mean(1)


def gradient_weighted(gradients: list[torch.Tensor], multipliers: list[torch.Tensor]) -> list[torch.Tensor]:
    """`weighted_head_mean` per attention: `W` the attention `A` itself, or its LRP relevance (generic attention's
    `weights="relevance"`, the authors' `use_lrp=True`; transformer attribution)."""
    return [weighted_head_mean(g, w) for g, w in zip(gradients, multipliers)]


def weighted_in_place(gradient: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`gradient_weighted` of one fresh gradient, written into it (`Forward.gradients`' combine): no second
    tensor of the attention's size is allocated."""
    if gradient.is_contiguous() and gradient.shape == weights.shape:
        return gradient.mul_(weights).clamp_(min=0).mean(1)
    return weighted_head_mean(gradient, weights)


def real_pairs(reader: Stream, key: Stream, like: torch.Tensor) -> torch.Tensor:
    """`(B, T_query, T_key)` bool of the (query, key) pairs of two real tokens, for `like` `(B, ..., T_query, T_key)`."""
    rows, columns = (
        stream.valid.to(like.device) if stream.valid is not None
        else torch.ones(len(like), tokens, dtype=torch.bool, device=like.device)
        for stream, tokens in ((reader, like.shape[-2]), (key, like.shape[-1]))
    )
    return rows[:, :, None] & columns[:, None, :]


def min_max(matrix: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """`(M - min) / (max - min)` over each `(B, T_query, T_key)` matrix's real pairs; a constant matrix gives zeros
    (where the references divide 0 by 0)."""
    low = matrix.masked_fill(~pairs, float("inf")).amin((-2, -1), keepdim=True)
    high = matrix.masked_fill(~pairs, float("-inf")).amax((-2, -1), keepdim=True)
    span = high - low
    return (matrix - low) / torch.where(span > 0, span, torch.ones_like(span))


def last_sites(sites: list[AttentionSite], reader: str, streams: dict[str, Stream]) -> dict[str, int]:
    """Per stream `x`, the index of the readout stream's last attention over `x` (self for `x == reader`)."""
    last: dict[str, int] = {}
    for k, site in enumerate(sites):
        if site.query == reader:
            last[site.key] = k
    missing = [x for x in streams if x not in last]
    if missing:
        raise UnsupportedModelError(f"the {reader} stream never attends to {', '.join(missing)}: no map for it")
    return last


def rollout_matrices(
    sites: list[AttentionSite], attentions: list[torch.Tensor], streams: dict[str, Stream], reader: str,
    row_normalize: bool = True,
) -> dict[str, torch.Tensor]:
    """Rollout across streams: each stream's self-attentions chained (`Â = I + Ā`, row-normalised), and for the
    other streams `x`, `roll(r)^T @ Ā_cross @ roll(x)` through the readout stream's last cross-attention into
    `x`, each roll taken over the self-attentions before it; the readout stream's own map rolls all its own."""
    def chained(stream: str, before: int) -> torch.Tensor:
        product = None
        for k in range(before):
            if sites[k].is_self and sites[k].query == stream:
                step = attentions[k].mean(1)
                step = step + torch.eye(step.shape[-1], dtype=step.dtype, device=step.device)
                if row_normalize:
                    step = step / step.sum(-1, keepdim=True)
                product = step if product is None else step @ product
        if product is None:
            batch, tokens = len(attentions[0]), next(a.shape[-1] for s, a in zip(sites, attentions) if s.key == stream)
            return _identity(batch, tokens, attentions[0])
        return product

    last = last_sites(sites, reader, streams)
    out = {reader: chained(reader, len(sites))}
    valid = streams[reader].valid
    for x, k in last.items():
        if x != reader:
            left = chained(reader, k)
            if valid is not None:  # padding queries attend too: keep their rows out of the sum over queries
                left = left * valid[:, :, None].to(left.dtype)
            out[x] = left.transpose(-1, -2) @ (attentions[k].mean(1) @ chained(x, k))
    return out


def row_of(matrices: dict[str, torch.Tensor], reader: Stream, streams: dict[str, Stream]) -> dict[str, torch.Tensor]:
    """The readout row of each stream's matrix over its content tokens."""
    rows = torch.arange(len(reader.readout), device=reader.readout.device)
    return {name: matrices[name][rows, reader.readout][:, streams[name].prefix_tokens:] for name in streams}


def cross_options_error(options: dict[str, Any]) -> None:
    """The co-attention options are refused on models without cross-attention, naming them."""
    given = [name for name, value in options.items() if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} apply to models whose streams attend to each other (LXMERT, DETR); this model has "
            "self-attention only"
        )
