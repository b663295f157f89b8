"""The rule maps of transformers' Swin V1 and V2: timm's Swin rules (`rules.py`) on transformers' modules, so that
one set of weights gives the same maps in both libraries.

Window attention is the shared attention with the relative position bias plus the shifted windows' mask as its
additive mask (`rules.window_bias`); each layer's two residual adds get the add rule, its roll, window partition and
reverse move relevance with the tokens; the embedding's absolute position add (where the config has one) gets the
add rule; patch merging's concatenation moves relevance, its LayerNorm and Linear get their rules; the pooler's
average over the tokens shares the relevance in proportion to their values (`engine.mean_tokens`); the patch
embedding's convolution z^B (full LRP to the pixels).

V2: timm V2's cosine attention and continuous position bias (`rules.cosine_attend`, `rules.continuous_position_bias`)
on the separate q/k/v projections, the shifted windows' mask added twice as the model does; post-norm layers.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import ForwardFactory, MissingRuleError, Replacements, Session, add, by_type, mean_tokens, unchanged
from ..base import Adapter
from ..hf_attention import transformers_leaves
from .rules import continuous_position_bias, cosine_attend, two_residuals, window_bias


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


def _cosine_self_attention(attention: nn.Module, session: Session) -> Replacements:
    """`Swinv2SelfAttention`: q, k, v shaped into heads for timm V2's cosine attention with the continuous position
    bias; returns `(context,)`, or `(context, probabilities)` with `output_attentions`, as the model does."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool | None = False) -> tuple:
        windows, tokens, _ = hidden_states.shape
        shape = (windows, tokens, attention.num_attention_heads, attention.attention_head_size)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (attention.query, attention.key, attention.value))
        position = continuous_position_bias(attention.continuous_position_bias_mlp, attention.relative_coords_table,
                                            attention.relative_position_index, attention.num_attention_heads)
        # transformers' Swinv2 adds the shifted windows' mask to the scores twice (masked pairs get -200): so do we
        mask = None if attention_mask is None else 2 * attention_mask
        context, probabilities = cosine_attend(session, q, k, v, attention.logit_scale, position, mask, attention.dropout)
        context = context.transpose(1, 2).reshape(windows, tokens, -1)
        return (context, probabilities) if output_attentions else (context,)

    return {"forward": forward}


def _in_windows(layer: nn.Module, x: torch.Tensor, dimensions: tuple[int, int], roll: Callable[[torch.Tensor, bool], torch.Tensor],
                attention: Callable[[torch.Tensor, torch.Tensor | None], tuple]) -> tuple:
    """A layer's windowed attention on `x` `(B, h * w, C)` with the model's own window partition and reverse:
    rolled by the shift (`roll(t, back)`), attended per window with the layer's shifted-window mask, put back and
    rolled back; returns `(output, *what the attention returns after its output)`. (Grids the windows do not divide
    are refused before.)"""
    modeling = sys.modules[type(layer).__module__]  # swin's or swinv2's window_partition / window_reverse
    (height, width), size = dimensions, layer.window_size
    batch, _, channels = x.shape
    shifted = roll(x.view(batch, height, width, channels), False)
    mask = layer.get_attn_mask(height, width, dtype=x.dtype, device=x.device)
    output, *rest = attention(modeling.window_partition(shifted, size).view(-1, size * size, channels), mask)
    output = modeling.window_reverse(output.view(-1, size, size, channels), size, height, width)
    return (roll(output, True).reshape(batch, height * width, channels), *rest)


def _layer(layer: nn.Module, session: Session) -> Replacements:
    """`SwinLayer` (pre-norm): the model's own shift (`set_shift_and_window_size`, `cyclic_shift`) around the windowed
    attention (`_in_windows`), the two residual adds under the add rule (`rules.two_residuals`)."""

    def forward(hidden_states: torch.Tensor, input_dimensions: tuple[int, int], always_partition: bool = False, **kwargs) -> tuple:
        if not always_partition:
            layer.set_shift_and_window_size(input_dimensions)
        found = []

        def attention(x: torch.Tensor) -> torch.Tensor:
            output, probabilities = _in_windows(layer, layer.layernorm_before(x), input_dimensions,
                                                lambda t, back: layer.cyclic_shift(t, reverse=back),
                                                lambda windows, mask: layer.attention(windows, mask, **kwargs))
            found.append(probabilities)
            return layer.drop_path(layer.dropout(output))

        x = two_residuals(session, hidden_states, attention, lambda x: layer.dropout(layer.mlp(layer.layernorm_after(x))))
        return x, found[0]

    return {"forward": forward}


def _post_norm_layer(layer: nn.Module, session: Session) -> Replacements:
    """`Swinv2Layer` (post-norm): `x + drop_path(layernorm_before(attention(x)))`, then `x +
    drop_path(layernorm_after(mlp(x)))` (`rules.two_residuals`), the attention windowed with the layer's fixed shift
    (`_in_windows`); returns `(x,)`, or `(x, probabilities)` with `output_attentions`, as the model does."""

    def forward(hidden_states: torch.Tensor, input_dimensions: tuple[int, int], output_attentions: bool | None = False) -> tuple:
        shift, rest = layer.shift_size, []

        def attention(x: torch.Tensor) -> torch.Tensor:
            output, *others = _in_windows(layer, x, input_dimensions,
                                          lambda t, back: torch.roll(t, (shift, shift) if back else (-shift, -shift), (1, 2)),
                                          lambda windows, mask: layer.attention(windows, mask, output_attentions=output_attentions))
            rest.extend(others)
            return layer.drop_path(layer.layernorm_before(output))

        x = two_residuals(session, hidden_states, attention,
                          lambda x: layer.drop_path(layer.layernorm_after(layer.output(layer.intermediate(x)))))
        return (x, *rest)

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


def _shared_rules(adapter: Adapter) -> dict[type, ForwardFactory]:
    """The entries V1 and V2 share: leaves, the pixel convolution, the containers, the embeddings and the pooler."""
    backbone, layers = adapter.backbone, adapter.blocks
    return {
        **transformers_leaves(),
        nn.Conv2d: engine.PIXEL_CONV,
        **by_type([adapter.model, backbone, backbone.encoder, backbone.embeddings.patch_embeddings, *adapter.stage_modules,
                   *(stage.downsample for stage in adapter.stage_modules), *(layer.drop_path for layer in layers)], unchanged),
        **by_type([backbone.embeddings], _embeddings),
        **by_type([backbone.pooler], _average_pool),
    }


def rule_map(adapter: Adapter) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of a transformers Swin V1, keyed by the types it was built with (by role)."""
    layers = adapter.blocks
    return {
        **_shared_rules(adapter),
        **by_type([*(layer.mlp for layer in layers), *(layer.attention.relative_position_bias for layer in layers)], unchanged),
        **by_type(layers, _layer),
        **by_type([layer.attention for layer in layers], _attention),
    }


def rule_map_v2(adapter: Adapter) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of a transformers Swin V2, keyed by the types it was built with (by role):
    the attention, its output projection and the MLP's two halves run as they are (their Linear and activation
    leaves get their rules)."""
    layers = adapter.blocks
    return {
        **_shared_rules(adapter),
        **by_type([module for layer in layers for module in (layer.attention, layer.attention.output, layer.intermediate, layer.output)], unchanged),
        **by_type(layers, _post_norm_layer),
        **by_type([layer.attention.self for layer in layers], _cosine_self_attention),
    }
