"""The rule map of transformers' Swin: timm's Swin rules (`rules.py`) on transformers' modules, so that one set of
weights gives the same maps in both libraries.

Window attention is the shared attention with the relative position bias plus the shifted windows' mask as its
additive mask (`rules.window_bias`); each layer's two residual adds get the add rule, its roll, window partition and
reverse move relevance with the tokens; the embedding's absolute position add (where the config has one) gets the
add rule; patch merging's concatenation moves relevance, its LayerNorm and Linear get their rules; the pooler's
average over the tokens shares the relevance in proportion to their values (`engine.mean_tokens`); the patch
embedding's convolution z^B (full LRP to the pixels).
"""
from __future__ import annotations

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import ForwardFactory, MissingRuleError, Replacements, Session, add, branch, by_type, mean_tokens, unchanged
from ..base import Adapter
from ..hf_attention import transformers_leaves
from .rules import window_bias


def _attention(attention: nn.Module, session: Session) -> Replacements:
    """`SwinAttention`: q, k, v shaped into heads for the shared attention; returns `(output, probabilities)`."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **_kwargs) -> tuple:
        windows, tokens, _ = hidden_states.shape
        shape = (windows, tokens, -1, attention.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        bias = window_bias(attention.relative_position_bias(), attention_mask, windows)
        context, probabilities = attend(session, q, k, v, attention.scaling, bias)
        return attention.o_proj(context.transpose(1, 2).reshape(windows, tokens, -1)), probabilities

    return {"forward": forward}


def _layer(layer: nn.Module, session: Session) -> Replacements:
    """`SwinLayer`: the model's own shift, window partition and reverse around the attention, each residual add
    under the add rule; the input of each feeds two branches. (Grids the windows do not divide are refused before.)"""
    from transformers.models.swin.modeling_swin import window_partition, window_reverse

    def forward(hidden_states: torch.Tensor, input_dimensions: tuple[int, int], always_partition: bool = False, **kwargs) -> tuple:
        if not always_partition:
            layer.set_shift_and_window_size(input_dimensions)
        (height, width), size = input_dimensions, layer.window_size
        batch, _, channels = hidden_states.shape
        x = branch(session, hidden_states)
        shifted = layer.cyclic_shift(layer.layernorm_before(x).view(batch, height, width, channels))
        mask = layer.get_attn_mask(height, width, dtype=x.dtype, device=x.device)
        output, probabilities = layer.attention(window_partition(shifted, size).view(-1, size * size, channels), mask, **kwargs)
        output = window_reverse(layer.dropout(output).view(-1, size, size, channels), size, height, width)
        x = add(session, x, layer.drop_path(layer.cyclic_shift(output, reverse=True).reshape(batch, height * width, channels)))
        x = branch(session, x)
        return add(session, x, layer.dropout(layer.mlp(layer.layernorm_after(x)))), probabilities

    return {"forward": forward}


def _embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`SwinEmbeddings`: patches, LayerNorm, the absolute position embedding (where the config has one) added under
    the add rule."""

    def forward(pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None, interpolate_pos_encoding: bool = False) -> tuple:
        if bool_masked_pos is not None:
            raise MissingRuleError("relevance propagation does not support masked image modelling (bool_masked_pos)")
        tokens, dimensions = embeddings.patch_embeddings(pixel_values)
        tokens = embeddings.norm(tokens)
        if embeddings.position_embeddings is not None:
            tokens = add(session, tokens, embeddings.position_embeddings)
        return embeddings.dropout(tokens), dimensions

    return {"forward": forward}


def _average_pool(pool: nn.Module, session: Session) -> Replacements:
    """The pooler `AdaptiveAvgPool1d(1)` over `(B, C, N)` under the mean's rule."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mean_tokens(session, x.transpose(1, 2))[..., None]

    return {"forward": forward}


def rule_map(adapter: Adapter) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of the adapter's model, keyed by the types it was built with (by role)."""
    backbone, layers = adapter.backbone, adapter.blocks
    return {
        **transformers_leaves(),
        nn.Conv2d: engine.PIXEL_CONV,
        **by_type([adapter.model, backbone, backbone.encoder, backbone.embeddings.patch_embeddings, *adapter.stage_modules,
                   *(stage.downsample for stage in adapter.stage_modules), *(layer.mlp for layer in layers),
                   *(layer.drop_path for layer in layers), *(layer.attention.relative_position_bias for layer in layers)], unchanged),
        **by_type([backbone.embeddings], _embeddings),
        **by_type(layers, _layer),
        **by_type([layer.attention for layer in layers], _attention),
        **by_type([backbone.pooler], _average_pool),
    }
