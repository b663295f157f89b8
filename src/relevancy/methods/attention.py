"""Methods that read attention probabilities only: raw attention and rollout (no gradients).

Every attention-based method runs per stream: on each stream's self-attentions, block by block, and reads the
stream's readout row ([CLS], or CLIP's end-of-text token) over its content tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from .capture import record_forward
from ..core.conventions import ClassEntry, check_choice, given_or
from ..families.base import Adapter
from ..core.streams import Stream
from .targets import Target
from . import coattention

StartLayer = int | dict[str, int] | None


def first_layer(start_layer: StartLayer, stream: Stream, depth: int) -> int:
    """The first block a rule uses in `stream` (of `depth` blocks): an index, negative ones from the end (-1: the
    last block only); a dict gives one per stream name."""
    value = start_layer.get(stream.name, 0) if isinstance(start_layer, dict) else start_layer
    if not isinstance(value, int) or isinstance(value, bool) or not -depth <= value < depth:
        raise ValueError(
            f"start_layer must be a block index in {-depth}..{depth - 1} for the {stream.name} stream ({depth} blocks; "
            f"-1: the last block only), got {value!r}"
        )
    return value % depth


def set_class_entry(scores: torch.Tensor, how: ClassEntry, stream: Stream) -> torch.Tensor:
    """The readout token's own entry of a readout-row map read over all tokens (no prefix tokens: text models):
    "keep" it, set it to "zero", or to the row's "min" over the real tokens. Maps without that column are unchanged."""
    check_choice("cls_entry", how, ClassEntry)
    if how == "keep" or stream.prefix_tokens != 0 or stream.readout is None:
        return scores
    scores = scores.clone()
    rows = torch.arange(len(scores), device=scores.device)
    if how == "zero":
        scores[rows, stream.readout] = 0
    else:
        row = scores if stream.valid is None else scores.masked_fill(~stream.valid, float("inf"))
        scores[rows, stream.readout] = row.amin(-1)
    return scores


def times(row: torch.Tensor, matrix: torch.Tensor, windows: torch.Tensor | None = None) -> torch.Tensor:
    """`row @ matrix` for rows `(B, [H,] T)` and a token matrix `(B, [H,] T, T)`, or a windowed one `(B * n, [H,] w, w)`
    whose window `j` holds the tokens `windows[j]` (`TokenLayout`): block by block, no `(T, T)` matrix made."""
    if windows is None:
        return torch.matmul(row.unsqueeze(-2), matrix).squeeze(-2)
    blocks = matrix.unflatten(0, (-1, len(windows)))  # (B, n, [H,] w, w)
    if blocks.ndim == 5:
        blocks = blocks.transpose(1, 2)  # (B, H, n, w, w)
    parts = torch.matmul(row[..., windows].unsqueeze(-2), blocks).squeeze(-2)  # (B, [H,] n, w)
    out = parts.new_zeros(*parts.shape[:-2], windows.numel())
    out[..., windows.flatten()] = parts.flatten(-2)
    return out


def site_windows(stream: Stream, site: int) -> torch.Tensor | None:
    """The windows of a stream's self-attention site `site` (negative: from the end), None where it sees every token."""
    return None if stream.layout is None else stream.layout.windows[site]


def readout_vector(stream: Stream, matrix: torch.Tensor, windows: torch.Tensor | None) -> torch.Tensor:
    """`(B, T)` weights of the tokens a stream is read from, at a site whose matrix is `matrix`: 1 at the readout
    token, or the mean of the content tokens where the model pools (the pooled token)."""
    batch = len(matrix) // (1 if windows is None else len(windows))
    tokens = matrix.shape[-1] if windows is None else windows.numel()
    weights = matrix.new_zeros(batch, tokens)
    if stream.pooled:
        weights[:, stream.prefix_tokens:] = 1 / (tokens - stream.prefix_tokens)
    else:
        weights[torch.arange(batch, device=matrix.device), stream.readout.to(matrix.device)] = 1
    return weights


def site_row(matrix: torch.Tensor, stream: Stream, site: int = -1) -> torch.Tensor:
    """The readout row of the token matrix of self-attention site `site` (`(B, T, T)`, or each head's `(B, H, T, T)`;
    windowed where the stream's layout says) over all the site's tokens: `(B, [H,] T)`. Global pooling: the pooled
    token's row, the mean of the content rows."""
    windows = site_windows(stream, site)
    if windows is None and not stream.pooled:
        rows = torch.arange(len(matrix), device=matrix.device)
        readout = stream.readout.to(matrix.device)
        return matrix[rows, :, readout] if matrix.ndim == 4 else matrix[rows, readout]
    vector = readout_vector(stream, matrix, windows)
    return times(vector if matrix.ndim == 3 else vector[:, None], matrix, windows)


def spread(row: torch.Tensor, merge: torch.Tensor | None) -> torch.Tensor:
    """A row over merged tokens `(B, [H,] N)` carried to the tokens they were made of (`TokenLayout.merges`): each
    finer token gets an equal share of its merged token's value (`row @ M`, `M` the merge's averaging matrix)."""
    if merge is None:
        return row
    finer = row.new_zeros(*row.shape[:-1], merge.numel())
    finer[..., merge.flatten()] = (row / merge.shape[1]).repeat_interleave(merge.shape[1], -1)
    return finer


def on_grid(row: torch.Tensor, stream: Stream, site: int = -1) -> torch.Tensor:
    """A row over the tokens of self-attention site `site` at the stream's content tokens: its content columns, and
    on a hierarchical stream carried down through every merge before the site to the first stage's grid (`spread`)."""
    row = row[..., stream.prefix_tokens:]
    if stream.layout is None:
        return row
    for merge in reversed(stream.layout.merges[:site % len(stream.layout.merges) + 1]):
        row = spread(row, merge)
    return row


def readout_row(matrix: torch.Tensor, stream: Stream, site: int = -1) -> torch.Tensor:
    """The readout row of site `site`'s token matrix (see `site_row`) at the content tokens: `(B, N)` (or `(B, H, N)`)."""
    return on_grid(site_row(matrix, stream, site), stream, site)


def per_stream(adapter: Adapter, inputs: Any, how: ClassEntry, compute) -> dict[str, torch.Tensor]:
    """`compute(stream)` for every stream, its [CLS] entry set as `how` says (see `set_class_entry`)."""
    return {name: set_class_entry(compute(stream), how, stream) for name, stream in adapter.streams(inputs).items()}


def check_start_layer(start_layer: int, blocks: int) -> None:
    """A one-line error unless `start_layer` is a block index of a model with `blocks` blocks."""
    if not 0 <= start_layer < blocks:
        raise ValueError(f"start_layer must be in 0..{blocks - 1} for a model with {blocks} blocks, got {start_layer}")


def chain(matrices: list[torch.Tensor], start_layer: int) -> torch.Tensor:
    """`M_last @ ... @ M_start`: how the first block's tokens reach the last block's output."""
    check_start_layer(start_layer, len(matrices))
    joint = matrices[start_layer]
    for matrix in matrices[start_layer + 1:]:
        joint = matrix @ joint
    return joint


def readout_chain(matrices: list[torch.Tensor], stream: Stream, start_layer: int = 0, identity: bool = False,
                  first_site: int | None = None) -> torch.Tensor:
    """The readout row of `chain(matrices, start_layer)` at the content columns, `(B, N)`: the readout token's row of
    the last matrix carried back through the earlier ones, a `(T, T)` vector product per block instead of the
    `(T, T) @ (T, T)` product (long texts: 1,000 tokens make the full chain a tenth of a forward's work).
    `identity`: the chain of the `I + M` (the residual's share), carried as `r + r M`: no `(T, T)` identity is made
    and added per block (fewer operations and launches; the same numbers to rounding).
    A pooled or hierarchical stream (`Stream.pooled`, `Stream.layout`): the pooled token's row, carried through
    windowed matrices block by block and through each merge to the tokens it was made of (`spread`), down to the
    first stage's grid; the matrices used are the stream's last sites, or those from `first_site` on."""
    check_start_layer(start_layer, len(matrices))
    if stream.layout is not None or stream.pooled:
        return layout_chain(matrices[start_layer:], stream, identity, first_site)
    last = matrices[-1]
    rows = torch.arange(len(last), device=last.device)
    readout = stream.readout.to(last.device)
    row = last[rows, readout]
    if identity:
        row[rows, readout] += 1
    for matrix in reversed(matrices[start_layer:-1]):
        carried = torch.bmm(row.unsqueeze(1), matrix).squeeze(1)
        row = carried.add_(row) if identity else carried
    return row[..., stream.prefix_tokens:]


def layout_chain(used: list[torch.Tensor], stream: Stream, identity: bool, first_site: int | None) -> torch.Tensor:
    """`readout_chain` on a pooled or hierarchical stream: `used` the matrices of consecutive sites, the last one the
    stream's last site unless `first_site` says where they start."""
    depth = len(stream.layout.windows) if stream.layout is not None else len(used)
    first = depth - len(used) if first_site is None else first_site
    sites = range(first, first + len(used))
    row = readout_vector(stream, used[-1], site_windows(stream, sites[-1]))
    for site, matrix in zip(reversed(sites), reversed(used)):
        carried = times(row, matrix, site_windows(stream, site))
        row = carried + row if identity else carried
        if site > first and stream.layout is not None:
            row = spread(row, stream.layout.merges[site])
    return on_grid(row, stream, first)


def with_identity(matrix: torch.Tensor) -> torch.Tensor:
    """`I + M`, the residual connection's share."""
    return matrix + torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)


def read_cross(adapter: Adapter, inputs: Any, how: ClassEntry, matrices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Cross-attention models: the readout row of each stream's matrix, the readout token's own entry set as `how`
    says (see `set_class_entry`)."""
    streams = adapter.streams(inputs)
    reader = coattention.readout_stream(streams)
    scores = coattention.row_of(matrices, reader, streams)
    scores[reader.name] = set_class_entry(scores[reader.name], how, reader)
    return scores


def raw_attention(adapter: Adapter, inputs: Any, target: Target, cls_entry: str | None = None) -> tuple:
    """`cls_entry`: see `set_class_entry` (text models: the BERT reference sets it to "zero").
    Cross-attention models: `across.raw_attention`. The probabilities are read as the model has them: with
    gpt-oss's attention sinks a row sums to less than 1 (the sink's share is no key's)."""
    how = given_or(cls_entry, adapter.conventions.raw_attention.cls_entry)
    fwd = record_forward(adapter, inputs, target, attentions=True, share_rows=True, head_mean=True, last_attention_only=True)
    scores = per_stream(adapter, inputs, how, lambda stream: readout_row(fwd.self_attentions(stream.name)[-1][:, 0], stream))
    return scores, fwd.indices, fwd.logits


def rollout(
    adapter: Adapter, inputs: Any, target: Target, start_layer: int = 0, cls_entry: str | None = None,
    row_normalize: bool | None = None,
) -> tuple:
    """`cls_entry`: see `set_class_entry` (text models: the BERT reference sets it to "zero").
    `row_normalize`: divide each `I + A` by its row sums (Abnar & Zuidema; the default), or chain the raw
    `I + A` (the authors' VisualBERT code). Cross-attention models: `across.rollout`. With gpt-oss's attention
    sinks `A`'s rows sum to `s < 1` as the model has them; the row normalisation divides `I + A` by its own row
    sums `1 + s` (the sink's share is no key's and is not put back)."""
    conventions = adapter.conventions.rollout
    row_normalize = given_or(row_normalize, conventions.row_normalize)
    how = given_or(cls_entry, conventions.cls_entry)
    fwd = record_forward(adapter, inputs, target, attentions=True, share_rows=True, head_mean=True)

    def compute(stream: Stream) -> torch.Tensor:
        means = [a[:, 0] for a in fwd.self_attentions(stream.name)]  # (B, T, T) per block
        if not row_normalize:
            return readout_chain(means, stream, start_layer, identity=True)
        # every block's I + A and its row sums in one operation each, not one per block (a hierarchical stream's
        # stages differ in shape: one stack per shape)
        normalised = {}
        for shape in dict.fromkeys(m.shape for m in means):
            matrices = torch.stack([m for m in means if m.shape == shape])
            matrices.diagonal(dim1=-2, dim2=-1).add_(1)
            normalised[shape] = iter(matrices.div_(matrices.sum(-1, keepdim=True)))
        return readout_chain([next(normalised[m.shape]) for m in means], stream, start_layer)

    return per_stream(adapter, inputs, how, compute), fwd.indices, fwd.logits
