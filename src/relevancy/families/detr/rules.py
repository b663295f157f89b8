"""The relevance rule map of transformers `DetrForObjectDetection`: the ICCV'21 authors' DETR rules
(`Transformer-MM-Explainability/DETR`, `modules/layers.py` and `models/transformer.py`), on the unmodified model.

Relevance starts at the explained (query, class) logit and stops at the transformer's inputs: the encoder's input
tokens (the projected backbone features, the `image` stream) and the decoder's input (DETR's zero queries, the
`queries` stream). The backbone, the position embeddings and the box head get no relevance. Per module:
- Linear layers (projections, MLPs, class head): alpha=1, beta=0 with a shared denominator, then scaled per
  sample so that their input relevance sums to the relevance that arrived (the authors' DETR `Linear`; with the
  "vanilla" rules, which have no DETR reference, the scaling is left out);
- residual adds: the add rule with the per-sample rescaling (conserving);
- attention: `(q * scale) k^T` and `A v` under the halved two-operand rule; scale, mask and softmax pass relevance
  unchanged. The relevance at `A` (halved) is the authors' `get_attn_cam()`. The probabilities are recorded for the
  methods, encoder layers first, then per decoder layer self- and cross-attention (the adapter's site order);
- position embeddings added to queries and keys (`x + pos`): all of the sum's relevance goes to `x` (the authors'
  `WithPosEmbd`); LayerNorms and ReLU pass relevance unchanged.

`exact=True` reproduces the authors' arithmetic: their 1e-9 stabiliser in every division, their `Clone` factor
`x / (x + 1e-9)` wherever their graph splits a tensor (each encoder layer's input, every decoder layer's input but
the first, the `x + pos` feeding queries and keys, each LayerNorm output feeding a residual and a branch, the
encoder's output: kept by their transformer, copied to each decoder layer and split there into keys and values)
and their `IndexSelect` factor at the explained logit. The default leaves the factors out and divides stably (see
`relevancy.lrp.rules`): where a sum cancels below the floor its share is not the authors', which on the reference
case moves the maps by up to 45 % of their maximum (to 5e-9 where nothing cancels).

Not reproduced: when an attention's values are all zero (the first decoder self-attention, whose input is DETR's
zero queries), the authors rescale the relevance of its queries and keys to the whole output relevance; here the
values' half stays at that zero input. It changes no attention's relevance (so no map), only what reaches the
queries' input: as much stays with the values as the queries and keys pass on, so the relevance at the encoder's
input plus twice that at the zero queries is the explained logit's 1 (to the stabilisers' 1e-9 per step).
"""
from __future__ import annotations

import torch
from torch import nn

from ...lrp import rules
from ...lrp.attention import SCALED_QUERIES, attend
from ...lrp.engine import ForwardFactory, MissingRuleError, Replacements, Session, add, branch, default_leaves, passthrough, unchanged

IMAGE, QUERIES = "image", "queries"


def _linear(session: Session, x: torch.Tensor, weight: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """The authors' DETR Linear: alpha1-beta0, then (conserving rules) scaled per sample to the arriving total."""
    shares = rules.linear_alpha1_beta0(x, weight, relevance, session.rule_set.shared_linear_denominator)
    if not session.rule_set.rescale_residuals:
        return shares
    return shares * rules.safe_divide(rules.per_sample_sum(relevance), rules.per_sample_sum(shares))


def _linear_entry(head: nn.Linear) -> ForwardFactory:
    """Every nn.Linear gets the DETR Linear rule; the class head first takes the authors' `IndexSelect` factor at
    the explained logit (exact sessions)."""

    def factory(module: nn.Linear, session: Session) -> Replacements:
        def rule(session: Session, inputs: tuple, output: torch.Tensor, relevance: torch.Tensor) -> tuple[torch.Tensor]:
            if module is head and session.exact:
                relevance = rules.reweigh_branches(output, relevance)
            return (_linear(session, inputs[0], module.weight, relevance),)

        original = module.forward
        return {"forward": lambda x: session.apply(rule, original, x)}

    return factory


def _with_position(session: Session, x: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """`x + position` with all of its relevance going to `x` (the authors' `WithPosEmbd`)."""
    return x if position is None else passthrough(session, lambda t: t + position, x)


def _attend(
    session: Session, attention: nn.Module, query_input: torch.Tensor, key_input: torch.Tensor, values: torch.Tensor,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(o_proj(softmax((q * scale) k^T + mask) v), probabilities)`, the products in the authors' order."""
    batch, queries, _ = query_input.shape
    keys = key_input.shape[1]
    dim = attention.head_dim

    def heads(x: torch.Tensor, tokens: int) -> torch.Tensor:
        return x.view(batch, tokens, -1, dim).transpose(1, 2)

    q = heads(attention.q_proj(query_input), queries)
    k, v = heads(attention.k_proj(key_input), keys), heads(attention.v_proj(values), keys)
    output, probabilities = attend(session, q, k, v, attention.scaling, mask, style=SCALED_QUERIES)
    return attention.o_proj(output.transpose(1, 2).reshape(batch, queries, -1)), probabilities


def _self_attention(attention: nn.Module, session: Session) -> Replacements:
    """`DetrSelfAttention`: queries and keys from `x + pos` (one tensor feeding both: a split), values from `x`."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: torch.Tensor | None = None, **_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        query_key = branch(session, _with_position(session, hidden_states, position_embeddings))
        return _attend(session, attention, query_key, query_key, hidden_states, attention_mask)

    return {"forward": forward}


def _cross_attention(attention: nn.Module, session: Session) -> Replacements:
    """`DetrCrossAttention`: queries from `x + query pos`, keys from `memory + spatial pos`, values from the memory
    (which feeds both: a split)."""

    def forward(hidden_states: torch.Tensor, key_value_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: torch.Tensor | None = None, encoder_position_embeddings: torch.Tensor | None = None,
                **_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        memory = branch(session, key_value_states)
        query_input = _with_position(session, hidden_states, position_embeddings)
        key_input = _with_position(session, memory, encoder_position_embeddings)
        return _attend(session, attention, query_input, key_input, memory, attention_mask)

    return {"forward": forward}


def _encoder_layer(layer: nn.Module, session: Session) -> Replacements:
    """`DetrEncoderLayer` (post-norm): `LN(x + attn(x))`, then `LN(x + mlp(x))`; the layer's input and the first
    LayerNorm's output each feed several branches."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                spatial_position_embeddings: torch.Tensor | None = None, **_kwargs) -> torch.Tensor:
        x = branch(session, hidden_states)
        attended, _ = layer.self_attn(hidden_states=x, attention_mask=attention_mask, position_embeddings=spatial_position_embeddings)
        x = branch(session, layer.self_attn_layer_norm(add(session, x, attended)))
        return layer.final_layer_norm(add(session, x, layer.mlp(x)))

    return {"forward": forward}


def _decoder_layer(first: nn.Module) -> ForwardFactory:
    """`DetrDecoderLayer` (post-norm): self-attention, cross-attention into the memory, MLP, each `LN(x + f(x))`.
    The authors' decoder keeps every layer's output for its auxiliary heads: a split at the input of every layer
    but the first (their first layer's input split is a plain sum)."""

    def factory(layer: nn.Module, session: Session) -> Replacements:
        def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    spatial_position_embeddings: torch.Tensor | None = None,
                    object_queries_position_embeddings: torch.Tensor | None = None,
                    encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                    **_kwargs) -> torch.Tensor:
            x = hidden_states if layer is first else branch(session, hidden_states)
            attended, _ = layer.self_attn(hidden_states=x, attention_mask=attention_mask,
                                          position_embeddings=object_queries_position_embeddings)
            x = branch(session, layer.self_attn_layer_norm(add(session, x, attended)))
            attended, _ = layer.encoder_attn(
                hidden_states=x, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask,
                position_embeddings=object_queries_position_embeddings, encoder_position_embeddings=spatial_position_embeddings,
            )
            x = branch(session, layer.encoder_attn_layer_norm(add(session, x, attended)))
            return layer.final_layer_norm(add(session, x, layer.mlp(x)))

        return {"forward": forward}

    return factory



def _encoder(encoder: nn.Module, session: Session) -> Replacements:
    original = encoder.forward

    def forward(inputs_embeds: torch.Tensor | None = None, *args, **kwargs):
        return original(session.stream_input(IMAGE, inputs_embeds), *args, **kwargs)

    return {"forward": forward}


def _decoder(decoder: nn.Module, session: Session) -> Replacements:
    """`DetrDecoder`: its input (the zero queries) is the queries stream's input; the memory is split twice
    (the authors' transformer keeps it as an output, and their decoder hands one copy to each layer)."""
    original = decoder.forward

    def forward(inputs_embeds: torch.Tensor | None = None, *args, encoder_hidden_states: torch.Tensor | None = None, **kwargs):
        memory = branch(session, branch(session, encoder_hidden_states))
        return original(session.stream_input(QUERIES, inputs_embeds), *args, encoder_hidden_states=memory, **kwargs)

    return {"forward": forward}


def _outside_error(module: nn.Module, _session: Session) -> Replacements:
    """A module type without an entry inside the DETR transformer."""
    raise MissingRuleError(
        f"no relevance rule for module type {type(module).__module__}.{type(module).__name__} in the DETR transformer"
    )


def _inside(outside: set[nn.Module], factory: ForwardFactory) -> ForwardFactory:
    """`factory` for the transformer's modules; modules no relevance reaches (backbone, position embeddings, input
    projection, box head) keep their own forwards."""

    def entry(module: nn.Module, session: Session) -> Replacements:
        return {} if module in outside else factory(module, session)

    return entry


def rule_map(model: nn.Module) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of a transformers `DetrForObjectDetection`."""
    from transformers.models.detr import modeling_detr as detr

    inner = model.model
    outside = {
        m for part in (inner.backbone, inner.position_embedding, inner.input_projection, model.bbox_predictor)
        for m in part.modules()
    }
    entries: dict[type, ForwardFactory] = {
        **default_leaves(),
        nn.Module: _outside_error,
        detr.DetrForObjectDetection: unchanged,
        detr.DetrModel: unchanged,
        detr.DetrEncoder: _encoder,
        detr.DetrDecoder: _decoder,
        detr.DetrEncoderLayer: _encoder_layer,
        detr.DetrDecoderLayer: _decoder_layer(inner.decoder.layers[0]),
        detr.DetrSelfAttention: _self_attention,
        detr.DetrCrossAttention: _cross_attention,
        detr.DetrMLP: unchanged,
        nn.Linear: _linear_entry(model.class_labels_classifier),
    }
    return {cls: _inside(outside, factory) for cls, factory in entries.items()}
