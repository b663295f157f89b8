"""The rule map of the Hugging Face vision transformers (ViT, DeiT, DINOv2, DINOv2 with registers).

The same rules as timm's VisionTransformer (`families/timm_vit/rules.py`), on transformers' modules, so that one
set of weights gives the same maps in both libraries:
- attention: `(q k^T) * scale` and `A v` get the halved two-operand rule; scale and softmax (in the model's dtype)
  pass relevance; the probabilities are recorded for the methods;
- each layer's two residual adds get the add rule (residual first, as timm), the input of each feeds two branches;
- the position-embedding add gets the add rule (DINOv2 with registers inserts its registers after it, as the
  model does); the patch embedding's convolution gets z^B (full LRP to the pixels);
- LayerNorm, layer scale and the activations pass relevance; Linear layers get the Linear rule;
- the head: [CLS] readout (the reference's `IndexSelect` factor when exact), DeiT-with-teacher's average of its
  two heads under the add rule (each half passes), DINOv2 classifiers' mean patch token shares its relevance over
  the patch tokens in proportion to their values (the add rule over N terms, stably divided).
SwiGLU feed-forwards (DINOv2 giant): the gating product gets the gate rule (all relevance to the value).
"""
from __future__ import annotations

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import PASSTHROUGH, ForwardFactory, Replacements, Session, add, branch, by_type, first_token, passthrough, unchanged
from ..base import Adapter
from ..hf_attention import gated_mlp, transformers_leaves
from .heads import HeadOps


def _attention(attention: nn.Module, session: Session) -> Replacements:
    """`ViTAttention`, `DeiTAttention`, `Dinov2Attention`: projections shaped into heads for the shared attention;
    returns `(output, probabilities)`."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **_kwargs) -> tuple:
        if attention_mask is not None:
            raise engine.MissingRuleError("relevance propagation does not support attention masks on vision transformers")
        batch, tokens, _ = hidden_states.shape
        shape = (batch, tokens, -1, attention.head_dim)
        q = attention.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = attention.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = attention.v_proj(hidden_states).view(shape).transpose(1, 2)
        context, probabilities = attend(session, q, k, v, attention.scaling)
        return attention.o_proj(context.transpose(1, 2).reshape(batch, tokens, -1)), probabilities

    return {"forward": forward}


def _layer(layer: nn.Module, session: Session) -> Replacements:
    """`ViTLayer`, `DeiTLayer` (pre-LN, dropout) and `Dinov2Layer` (pre-LN, layer scale, drop path)."""
    if hasattr(layer, "layer_scale1"):
        norms = (layer.norm1, layer.norm2)
        after = (lambda x: layer.drop_path(layer.layer_scale1(x)), lambda x: layer.drop_path(layer.layer_scale2(x)))
    else:
        norms = (layer.layernorm_before, layer.layernorm_after)
        after = (layer.dropout, layer.dropout)

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        x = branch(session, hidden_states)
        x = add(session, x, after[0](layer.attention(norms[0](x), attention_mask, **kwargs)[0]))
        x = branch(session, x)
        return add(session, x, after[1](layer.mlp(norms[1](x))))

    return {"forward": forward}


def _embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`*Embeddings`: [CLS] (and DeiT's distillation token) before the patches, the model's own (interpolated)
    position embedding added under the add rule, DINOv2's registers inserted after [CLS]."""
    prefix = [t for t in (embeddings.cls_token, getattr(embeddings, "distillation_token", None)) if t is not None]
    registers = getattr(embeddings, "register_tokens", None)

    def forward(pixel_values: torch.Tensor, bool_masked_pos: torch.Tensor | None = None, interpolate_pos_encoding: bool = True) -> torch.Tensor:
        if bool_masked_pos is not None:
            raise engine.MissingRuleError("relevance propagation does not support masked image modelling (bool_masked_pos)")
        height, width = pixel_values.shape[-2:]
        patches = embeddings.patch_embeddings(pixel_values)
        tokens = torch.cat([t.expand(len(patches), -1, -1) for t in prefix] + [patches], dim=1)
        position = embeddings.interpolate_pos_encoding(tokens, height, width) if interpolate_pos_encoding else embeddings.position_embeddings
        tokens = add(session, tokens, position)
        if registers is not None:
            tokens = torch.cat([tokens[:, :1], registers.expand(len(tokens), -1, -1), tokens[:, 1:]], dim=1)
        return embeddings.dropout(tokens)

    return {"forward": forward}


def head_ops(session: Session) -> HeadOps:
    """The head's operations under the rules: [CLS] readout, mean of tokens, average of two heads."""

    def average(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        half = lambda t: t / 2  # noqa: E731
        return add(session, passthrough(session, half, a), passthrough(session, half, b))

    return HeadOps(
        class_token=lambda hidden: first_token(session, hidden),
        mean_tokens=lambda tokens: engine.mean_tokens(session, tokens),
        average=average,
    )


def rule_map(adapter: Adapter) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of the adapter's model, keyed by the types the model was built with
    (found by role); the model itself also swaps the adapter's head operations for the rule-aware ones."""
    backbone, layers = adapter.backbone, adapter.blocks
    table: dict[type, ForwardFactory] = {
        **transformers_leaves(),
        nn.Conv2d: engine.PIXEL_CONV,
        # the bare models' pooler is not part of what is explained
        **by_type([backbone, getattr(backbone, "encoder", None), getattr(backbone, "pooler", None)], unchanged),
        **by_type([adapter.embeddings], _embeddings),
        **by_type([adapter.embeddings.patch_embeddings], unchanged),
        **by_type(layers, _layer),
        **by_type([layer.attention for layer in layers], _attention),
        **by_type([layer.mlp for layer in layers if not hasattr(layer.mlp, "gate_proj")], unchanged),
        **by_type([layer.mlp for layer in layers if hasattr(layer.mlp, "gate_proj")], gated_mlp),
        **by_type([getattr(layer, "drop_path", None) for layer in layers], unchanged),
        **by_type([getattr(layer, name, None) for layer in layers for name in ("layer_scale1", "layer_scale2")], PASSTHROUGH),
    }

    def model(module: nn.Module, session: Session) -> Replacements:
        return {(adapter, "ops"): head_ops(session)}

    table[type(adapter.model)] = model
    return table
