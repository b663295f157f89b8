"""What an adapter declares about a model: its token streams and its attention sites.

A one-stream model (ViT, BERT) has one stream and one self-attention site per block; CLIP has two streams
(`image`, `text`) that never attend to each other; co-attention and encoder-decoder models add cross sites
(query stream != key stream). Methods compute relevance per stream pair from these declarations alone, so they
are written once for every family: the ICCV'21 paper's `R^ii`, `R^tt`, `R^it`, `R^ti`. A stream may be fed by a
model of its own (`Feed`: a vision-language decoder's image tokens, made by its vision tower and projector).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

STREAM_KINDS = ("image", "text", "queries")


class Hookable(Protocol):
    """A module, or one part of a module's output, whose forward output can be observed."""

    def register_forward_hook(self, hook): ...


@dataclass(frozen=True)
class TokenLayout:
    """A hierarchical stream's tokens at each of its self-attention sites, in forward order (Swin).

    `windows[k]` `(n, w)`: site `k` attends within windows, its probabilities `(B * n, heads, w, w)`, and place `i`
    of window `j` holds the site's token `windows[k][j, i]` (its stage's tokens in raster order on that stage's
    grid, image coordinates: a shifted window's roll undone). `merges[k]` `(N_k, m)`: the tokens of site `k` are
    made of the tokens before it (the previous site's, or the stream's grid for `k = 0`) in groups of `m`, token `t`
    of the group `merges[k][t]` (patch merging: 2 x 2); None where they are the same tokens. Every token is in one
    window per site and one group per merge (no padding)."""

    windows: tuple[torch.Tensor, ...]
    merges: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class Stream:
    """One token stream of a batch.

    `prefix_tokens`: tokens before the content ([CLS], registers, distillation token); scores cover the tokens
    after them. `readout`: `(B,)` the token whose row a method reads ([CLS]: 0; CLIP text: the end-of-text
    token), None where the model pools (no such row). `valid`: `(B, T)` bool of the real tokens (None: all).
    `grid`: `(h, w)` of the content tokens of an image stream (a hierarchical stream's: its first stage's patch grid).
    `pooled`: the model averages the content tokens where it has no readout token (Swin's head): the methods that
    read a readout row read the pooled token's, the mean of the content rows. `layout`: where a hierarchical
    stream's attention sites sit on its tokens (windows, merges); None: every site attends over the whole stream.
    """

    name: str
    kind: str
    prefix_tokens: int
    readout: torch.Tensor | None
    valid: torch.Tensor | None = None
    grid: tuple[int, int] | None = None
    pooled: bool = False
    layout: TokenLayout | None = None

    def __post_init__(self) -> None:
        if self.kind not in STREAM_KINDS:
            raise ValueError(f"stream kind must be one of {', '.join(STREAM_KINDS)}, got {self.kind!r}")

    def content_valid(self) -> torch.Tensor | None:
        """`(B, N)` bool of the real content tokens (after the prefix), None when all are real."""
        return None if self.valid is None else self.valid[:, self.prefix_tokens:]


@dataclass(frozen=True)
class AttentionSite:
    """Where one attention's probabilities are: `probabilities` outputs `(B, heads, T_query, T_key)`, the tensor
    that multiplies the values, with queries from stream `query` and keys from stream `key`.

    `group`: sites of one adapter that share a group number are one co-attention step (LXMERT's two cross
    attentions of a layer): the relevance rules apply them all from the relevance matrices as they stood before
    the step. None: the site is a step of its own.
    """

    query: str
    key: str
    probabilities: Hookable
    group: int | None = None

    @property
    def is_self(self) -> bool:
        return self.query == self.key


def streams_attend_to_each_other(sites: Sequence[AttentionSite]) -> bool:
    """Whether some attention has queries and keys from different streams (LXMERT, DETR): then every map is read
    at one readout stream's row, and the methods take their co-attention strategy (`methods.across`)."""
    return any(not site.is_self for site in sites)


@dataclass(frozen=True)
class Feed:
    """Tokens of stream `into` made from the output tokens of a stream that runs before it, with no attention between
    the two (a vision-language decoder's image tokens, made by its projector from its vision tower's tokens).

    `source`: the feeding stream (its prefix tokens, its patch grid); `sites`: its self-attention sites in forward
    order; `depths`: after how many of them its tokens are read (several: read at each depth and put side by side,
    LLaVA's list of `vision_feature_layer`s); `positions` `(B, T)` bool: where they are in stream `into`, the same
    count N in every row; `weights` `(N, T_source)`: each fed token's share of each source token (rows summing to
    1: one token per source token, or a block of them pooled or shuffled into one); `tiles`: how many images of the
    source each row's fed tokens come from, one after the other (InternVL's tiles: the source runs `B * tiles` images,
    each fed token of a row's `tiles * N` its tile's by `weights`)."""

    source: Stream
    sites: tuple[AttentionSite, ...]
    depths: tuple[int, ...]
    into: str
    positions: torch.Tensor
    weights: torch.Tensor
    tiles: int = 1

