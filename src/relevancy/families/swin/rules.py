"""The rule map of timm's SwinTransformer family: which rule each module and operation gets.

Windows and shifts move tokens (`torch.roll`, the window partition and its reverse): their own backward carries
relevance with the tokens. Window attention is the shared attention over each window, the relative position bias
(plus the shifted windows' mask) an additive mask that passes relevance; each block's two residual adds get the
add rule; patch merging's 2 x 2 concatenation moves each token's relevance back to its place, its LayerNorm and
Linear get their rules; the head's global average pooling shares the relevance over the tokens in proportion to
their values (`engine.mean_tokens`); the patch embedding's convolution z^B (full LRP to the pixels).
"""
from __future__ import annotations

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import ForwardFactory, Replacements, Session, add, branch, mean_tokens, unchanged


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


def _block(block: nn.Module, session: Session) -> Replacements:
    """timm `SwinTransformerBlock`: the model's own shifted-window attention (`_attn`) and MLP, each residual add
    under the add rule; the input of each feeds two branches."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        batch, height, width, channels = x.shape
        x = branch(session, x)
        x = add(session, x, block.drop_path1(block._attn(block.norm1(x))))
        x = branch(session, x.reshape(batch, -1, channels))
        x = add(session, x, block.drop_path2(block.mlp(block.norm2(x))))
        return x.reshape(batch, height, width, channels)

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
    """Module type -> rule, for every module a timm SwinTransformer is built from (max pooling heads are refused by
    name: no rule)."""
    from timm.layers import ClassifierHead, DropPath, Mlp, PatchEmbed, SelectAdaptivePool2d
    from timm.layers.adaptive_avgmax_pool import FastAdaptiveAvgPool
    from timm.models.swin_transformer import (
        PatchMerging, SwinTransformer, SwinTransformerBlock, SwinTransformerStage, WindowAttention,
    )

    return {
        **engine.default_leaves(),
        SwinTransformer: unchanged,
        SwinTransformerStage: unchanged,
        SwinTransformerBlock: _block,
        WindowAttention: _window_attention,
        nn.Softmax: unchanged,  # WindowAttention's own softmax module, which its rule forward does not call
        PatchMerging: unchanged,
        Mlp: unchanged,
        PatchEmbed: unchanged,
        DropPath: unchanged,
        ClassifierHead: unchanged,
        SelectAdaptivePool2d: unchanged,
        FastAdaptiveAvgPool: _average_pool,
        nn.Conv2d: engine.PIXEL_CONV,
    }
