"""Rule maps of the decoder language models for the seeds' LRP methods (transformer attribution, LRP, partial LRP).

The CVPR'21 rules, applied to a pre-LN causal decoder as to timm's ViT (`families/timm_vit/rules.py`):
- self-attention: `(q k^T) * scale` and `A v` get the halved two-operand rule; scale, causal mask and softmax pass
  relevance; the probabilities are recorded for the methods. Grouped-query attention shares each key and value
  head among its query heads (their relevances add up); RoPE's rotation of queries and keys passes relevance
  coordinate to coordinate (a position-dependent rotation, it carries no relevance of its own);
- each layer's two residual adds get the add rule, the input of each feeds two branches;
- RMSNorm and LayerNorm pass relevance; Linear layers (and GPT-2's `Conv1D`, a Linear with its weight stored
  transposed) get the Linear rule; activations pass relevance; the gated MLP's product gets the gate rule (all
  relevance to the value `up_proj(x)`);
- the head reads each row's last real token (the adapter runs it on those rows only), so relevance starts there.
GPT-2 adds its position table to the token embeddings inside the decoder with a plain addition: all relevance of
the sum goes to the token embeddings, which are so the relevance at the first block's input (as the BERT reference
stops at the embedding output).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import attend
from ...lrp.engine import ForwardFactory, Replacements, Session, add, branch, by_type, leaf, passthrough, unchanged, weight_rule
from ..hf_attention import gated_mlp, transformers_leaves


def _no_cache_or_cross(kwargs: dict[str, Any]) -> None:
    """Relevance runs over the whole sequence at once: no KV cache, no cross-attention."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or kwargs.get("encoder_hidden_states") is not None:
        raise engine.MissingRuleError("relevance propagation runs decoders over the whole sequence: no KV cache, no cross-attention")


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: `x cos + rotate_half(x) sin`, with `cos`, `sin` `(B, T, d)` broadcast over the heads of `x` `(B, H, T, d)`."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


def _heads_attention(session: Session, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over `(B, H, T, d)` heads, key and value heads repeated for grouped queries; returns
    `(context (B, T, H * d), probabilities)`. No mask from the decoder (sdpa with no padding): the causal one."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    context, probabilities = attend(session, q, k, v, scale, mask, causal=mask is None)
    return context.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1), probabilities


def _llama_attention(attention: nn.Module, session: Session) -> Replacements:
    """`LlamaAttention` (and Qwen2's, Mistral's; Qwen3's with its per-head query and key norms before RoPE):
    projections, RoPE (passing relevance), grouped-query attention; returns `(output, probabilities)`."""
    q_norm, k_norm = (getattr(attention, name, nn.Identity()) for name in ("q_norm", "k_norm"))

    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs) -> tuple:
        _no_cache_or_cross(kwargs)
        shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
        hidden_states = branch(session, hidden_states)  # feeds the query, key and value projections
        q = q_norm(attention.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = k_norm(attention.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = attention.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        q = passthrough(session, lambda t: _rotated(t, cos, sin), q)
        k = passthrough(session, lambda t: _rotated(t, cos, sin), k)
        context, probabilities = _heads_attention(session, q, k, v, attention.scaling, attention_mask)
        return attention.o_proj(context), probabilities

    return {"forward": forward}


def _llama_layer(layer: nn.Module, session: Session) -> Replacements:
    """`LlamaDecoderLayer`: pre-norm attention and MLP, both residual adds under the add rule."""

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        x = branch(session, hidden_states)
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(x), **kwargs)
        x = branch(session, add(session, x, attended))
        return add(session, x, layer.mlp(layer.post_attention_layernorm(x)))

    return {"forward": forward}


def _gpt2_attention(attention: nn.Module, session: Session) -> Replacements:
    """`GPT2Attention` (self-attention): the fused `c_attn` split into heads, the model's scale (layer-wise where its
    config asks); returns `(output, probabilities)`."""

    def forward(hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None, **kwargs) -> tuple:
        _no_cache_or_cross({"cache": cache, **kwargs})
        shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
        q, k, v = (part.view(shape).transpose(1, 2) for part in attention.c_attn(hidden_states).split(attention.split_size, dim=2))
        context, probabilities = _heads_attention(session, q, k, v, attention.scaling, attention_mask)
        return attention.resid_dropout(attention.c_proj(context)), probabilities

    return {"forward": forward}


def _gpt2_block(block: nn.Module, session: Session) -> Replacements:
    """`GPT2Block` without cross-attention: both residual adds under the add rule."""

    def forward(hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        _no_cache_or_cross({"cache": cache, "encoder_hidden_states": encoder_hidden_states})
        kwargs.pop("encoder_attention_mask", None)
        x = branch(session, hidden_states)
        attended, _ = block.attn(block.ln_1(x), attention_mask=attention_mask, **kwargs)
        x = branch(session, add(session, x, attended))
        return add(session, x, block.mlp(block.ln_2(x)))

    return {"forward": forward}


#: transformers' `Conv1D` (GPT-2): `x W + b` with `W` stored `(in, out)`, under the Linear rule
CONV1D = leaf(lambda module: weight_rule(module.weight.t(), affine=True, bias=module.bias))


def _shared(model: nn.Module, decoder: nn.Module) -> dict[type, ForwardFactory]:
    """What both layouts share: transformers' leaves, and the model and decoder as they are (the decoder's rotary
    embedding and the mask it builds carry no relevance)."""
    return {**transformers_leaves(), **by_type([model, decoder, getattr(decoder, "rotary_emb", None)], unchanged)}


def llama_rules(model: nn.Module, decoder: nn.Module, layers: list[nn.Module]) -> dict[type, ForwardFactory]:
    """The Llama layout (Llama, Qwen2, Mistral, SmolLM2) and Qwen3's, keyed by the types of the model's own modules."""
    return {
        **_shared(model, decoder),
        **by_type(layers, _llama_layer),
        **by_type([layer.self_attn for layer in layers], _llama_attention),
        **by_type([layer.mlp for layer in layers], gated_mlp),
        **by_type([decoder.norm] + [norm for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
                  + [norm for layer in layers for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))],
                  engine.NORMALISATION),
    }


def gpt2_rules(model: nn.Module, decoder: nn.Module, layers: list[nn.Module]) -> dict[type, ForwardFactory]:
    """GPT-2 (`GPT2LMHeadModel`), keyed by the types of the model's own modules."""
    from transformers.pytorch_utils import Conv1D

    return {
        **_shared(model, decoder),
        Conv1D: CONV1D,
        **by_type(layers, _gpt2_block),
        **by_type([block.attn for block in layers], _gpt2_attention),
        **by_type([block.mlp for block in layers], unchanged),
    }
