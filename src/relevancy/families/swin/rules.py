"""The rule map of timm's SwinTransformer family (V1 and V2): which rule each module and operation gets.

Windows and shifts move tokens (`torch.roll`, the window partition and its reverse): their own backward carries
relevance with the tokens. Window attention is the shared attention over each window, the relative position bias
(plus the shifted windows' mask) an additive mask that passes relevance; each block's two residual adds get the
add rule; patch merging's 2 x 2 concatenation moves each token's relevance back to its place, its LayerNorm and
Linear get their rules; the head's global average pooling shares the relevance over the tokens in proportion to
their values (`engine.mean_tokens`); the patch embedding's convolution z^B (full LRP to the pixels).

V2's differences: cosine attention, q and k L2-normalised under the normalisation rule (the identity: relevance
passes, as through LayerNorm) and their products scaled by the learned per-head logit scale (clamped at log 100,
then exp), a constant that passes relevance like V1's `scale`; its continuous position bias `16 sigmoid(MLP(log-spaced
relative coordinates))` is input-independent, an additive mask like V1's table; the fused q/k/v projection with its
separate q and v biases gets the Linear rule; the blocks normalise after the attention and the MLP, inside the
residual branch (post-norm); patch merging's LayerNorm comes after its Linear.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import ForwardFactory, Replacements, Session, add, branch, linear, mean_tokens, normalisation, unchanged


def window_bias(bias: torch.Tensor, mask: torch.Tensor | None, windows: int) -> torch.Tensor:
    """The additive mask of window attention: the relative position bias `(1, heads, w, w)` plus, for shifted
    windows, their mask `(n, w, w)`, window `j` of each image taking mask `j` (`windows` = images x `n`)."""
    return bias if mask is None else (bias + mask[:, None]).repeat(windows // len(mask), 1, 1, 1)


def _window_attention(attn: nn.Module, session: Session) -> Replacements:
    """timm `WindowAttention`: the fused q/k/v projection shaped into heads for the shared attention, with the
    relative position bias (and a shifted window's mask, window `j` of each image taking mask `j`) added to the scores."""

    def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        windows, tokens, _ = x.shape
        q, k, v = attn.qkv(x).reshape(windows, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = window_bias(attn._get_rel_pos_bias(), mask, windows)
        context, _ = attend(session, q, k, v, attn.scale, bias, dropout=attn.attn_drop)
        return attn.proj_drop(attn.proj(context.transpose(1, 2).reshape(windows, tokens, -1)))

    return {"forward": forward}


def continuous_position_bias(mlp: nn.Module, coordinates: torch.Tensor, index: torch.Tensor, heads: int) -> torch.Tensor:
    """V2's continuous position bias `(heads, w, w)`: `16 sigmoid(mlp(log-spaced relative coordinates))` at each
    pair's relative offset (`index`, `(w, w)`)."""
    table = mlp(coordinates).view(-1, heads)
    return 16 * torch.sigmoid(table[index.view(-1)].view(*index.shape, heads).permute(2, 0, 1))


def cosine_attend(session: Session, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logit_scale: torch.Tensor,
                  bias: torch.Tensor, mask: torch.Tensor | None, dropout: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's cosine attention `(context, probabilities)`: q and k L2-normalised under the normalisation rule, the shared
    attention with the logit scale (clamped at log 100, then exp) as its scale and the position `bias` (plus a
    shifted window's `mask`, `window_bias`) as its additive mask."""

    def unit(t: torch.Tensor) -> torch.Tensor:
        return normalisation(session, lambda u: F.normalize(u, dim=-1), lambda u: u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12).detach(), t)

    scale = torch.clamp(logit_scale, max=math.log(1.0 / 0.01)).exp()
    return attend(session, unit(q), unit(k), v, scale, window_bias(bias[None], mask, len(q)), dropout=dropout)


def two_residuals(session: Session, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor],
                  mlp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A Swin block's `x + attention(x)`, then `+ mlp(.)` (each branch as the block computes it, norm and drop path
    included): each input feeds two branches, each add under the add rule."""
    x = branch(session, x)
    x = add(session, x, attention(x))
    x = branch(session, x)
    return add(session, x, mlp(x))


def _cosine_attention(attn: nn.Module, session: Session) -> Replacements:
    """timm V2 `WindowAttention`: the fused q/k/v projection (with its q and v biases) under the Linear rule, then
    the cosine attention (`cosine_attend`) with the continuous position bias."""

    def forward(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        windows, tokens, _ = x.shape
        bias = None if attn.q_bias is None else torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        qkv = linear(session, lambda t: F.linear(t, attn.qkv.weight, bias), x, attn.qkv.weight)
        q, k, v = qkv.reshape(windows, tokens, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        position = continuous_position_bias(attn.cpb_mlp, attn.relative_coords_table, attn.relative_position_index, attn.num_heads)
        context, _ = cosine_attend(session, q, k, v, attn.logit_scale, position, mask, attn.attn_drop)
        return attn.proj_drop(attn.proj(context.transpose(1, 2).reshape(windows, tokens, -1)))

    return {"forward": forward}


def _block(block: nn.Module, session: Session) -> Replacements:
    """timm `SwinTransformerBlock` (pre-norm) and `SwinTransformerV2Block` (post-norm: each branch normalised at its
    end): the model's own shifted-window attention (`_attn`) and MLP, each residual add under the add rule; the input
    of each feeds two branches."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    if isinstance(block, SwinTransformerV2Block):
        attention, mlp = (lambda x: block.norm1(block._attn(x))), (lambda x: block.norm2(block.mlp(x)))
    else:
        attention, mlp = (lambda x: block._attn(block.norm1(x))), (lambda x: block.mlp(block.norm2(x)))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return two_residuals(session, x, lambda t: block.drop_path1(attention(t)), lambda t: block.drop_path2(mlp(t)))

    return {"forward": forward}


def _average_pool(pool: nn.Module, session: Session) -> Replacements:
    """timm's `FastAdaptiveAvgPool` (global average pooling, NHWC or NCHW) under the mean's rule."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        channels_last = tuple(pool.dim) == (1, 2)
        pooled = mean_tokens(session, x.flatten(1, 2) if channels_last else x.flatten(2).transpose(1, 2))
        if pool.flatten:
            return pooled
        return pooled[:, None, None] if channels_last else pooled[..., None, None]

    return {"forward": forward}


def rule_map() -> dict[type, ForwardFactory]:
    """Module type -> rule, for every module a timm SwinTransformer or SwinTransformerV2 is built from (max pooling
    heads are refused by name: no rule)."""
    from timm.layers import ClassifierHead, DropPath, Mlp, PatchEmbed, SelectAdaptivePool2d
    from timm.layers.activations import GELU
    from timm.layers.adaptive_avgmax_pool import FastAdaptiveAvgPool
    from timm.models import swin_transformer as v1, swin_transformer_v2 as v2

    return {
        **engine.default_leaves(),
        **{kind: unchanged for kind in (v1.SwinTransformer, v1.SwinTransformerStage, v1.PatchMerging, v2.SwinTransformerV2,
                                        v2.SwinTransformerV2Stage, v2.PatchMerging)},
        v1.SwinTransformerBlock: _block,
        v2.SwinTransformerV2Block: _block,
        v1.WindowAttention: _window_attention,
        v2.WindowAttention: _cosine_attention,
        nn.Softmax: unchanged,  # WindowAttention's own softmax module, which its rule forward does not call
        GELU: engine.ACTIVATION,  # timm's own GELU module (V2's `act_layer="gelu"`)
        Mlp: unchanged,
        PatchEmbed: unchanged,
        DropPath: unchanged,
        ClassifierHead: unchanged,
        SelectAdaptivePool2d: unchanged,
        FastAdaptiveAvgPool: _average_pool,
        nn.Conv2d: engine.PIXEL_CONV,
    }
