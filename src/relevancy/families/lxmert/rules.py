"""The relevance rule map of transformers' LXMERT (`LxmertForQuestionAnswering`, `LxmertForPreTraining`'s QA head):
the ICCV'21 authors' LXMERT LRP rules (`Transformer-MM-Explainability/lxmert/lxmert/src/lxmert_lrp.py` on their
`layers.py`), on the unmodified model.

Relevance starts at the explained answer logit (1 there, the authors' one-hot) and stops at the encoder's inputs:
the embedded question (the `text` stream) and the encoded regions (`visn_fc`'s output, the `image` stream). Per module:
- Linear layers (q/k/v, attention outputs, FFNs, pooler, answer head): alpha=1, beta=0 with a shared denominator;
- residual adds (`LayerNorm(dense(h) + input)`): the add rule with the per-sample rescaling (conserving);
- attention: `q k^T` and `A v` under the halved two-operand rule; the `1/sqrt(d)` scale, the additive mask (their
  relprop skips it) and the softmax pass relevance unchanged. The relevance at `A` (halved) is the authors'
  `get_attn_cam()`. The probabilities are recorded in forward order: language layers, relation layers, then per
  cross layer its `visual_attention` run text->image, then image->text (their `visual_attention_copy`),
  `lang_self_att`, `visn_self_att` (the adapter's site order);
- LayerNorms, GELU (the FFNs' and the answer head's), tanh (pooler) and dropout pass relevance unchanged;
- the pooler's [CLS] readout sends its relevance to token 0.

`exact=True` reproduces the authors' arithmetic: their 1e-9 stabiliser in every division, their `Clone` factor
`x / (x + 1e-9)` wherever their graph splits a tensor (each attention's context into keys and values, every
attention layer's input into query, context and residual, each FFN's input into the FFN and its residual, each
cross layer's two inputs into its two cross-attention runs) and their `IndexSelect` factor at the pooled [CLS].
The default leaves those factors out (their only effect is `x / (x + 1e-9)`) and divides stably (see
`relevancy.lrp.rules`): where a sum cancels below the floor its share is held there instead of amplifying rounding.
On the reference case, whose random weights make sums cancel, that moves the maps by up to 69 % of their maximum.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...lrp.attention import AttentionStyle, attend
from ...lrp.engine import ACTIVATION, ForwardFactory, MissingRuleError, Replacements, Session, branch, default_leaves, first_token, unchanged
from ..hf_attention import post_norm_residual

_DIVIDED = AttentionStyle(scale="divide")  # the authors' LXMERT divides the products by sqrt(d)

TEXT, IMAGE = "text", "image"


def _attention(attention: nn.Module, session: Session) -> Replacements:
    """`LxmertAttention`: queries from `hidden_states`, keys and values from `context` (one tensor feeding both: a
    split); `(context_layer,)` or `(context_layer, probabilities)` as the model returns them."""
    head = attention.attention_head_size
    scale = math.sqrt(head)

    def forward(hidden_states: torch.Tensor, context: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> tuple:
        context = branch(session, context)

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(*x.shape[:-1], -1, head).transpose(1, 2)

        q, k, v = heads(attention.query(hidden_states)), heads(attention.key(context)), heads(attention.value(context))
        attended, probabilities = attend(session, q, k, v, scale, attention_mask, style=_DIVIDED, dropout=attention.dropout)
        attended = attended.permute(0, 2, 1, 3).contiguous()
        attended = attended.view(*attended.shape[:-2], attention.head_size)
        return (attended, probabilities) if output_attentions else (attended,)

    return {"forward": forward}


def _self_attention_layer(layer: nn.Module, session: Session) -> Replacements:
    """`LxmertSelfAttentionLayer`: its input feeds the query, the context and the residual."""

    def forward(input_tensor: torch.Tensor, attention_mask: torch.Tensor | None, output_attentions: bool = False) -> tuple:
        x = branch(session, input_tensor)
        output = layer.self(x, x, attention_mask, output_attentions=output_attentions)
        return (layer.output(output[0], x), *output[1:])

    return {"forward": forward}


def _cross_attention_layer(layer: nn.Module, session: Session) -> Replacements:
    """`LxmertCrossAttentionLayer`: its input feeds the query and the residual; the context is the other stream."""

    def forward(input_tensor: torch.Tensor, ctx_tensor: torch.Tensor, ctx_att_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> tuple:
        x = branch(session, input_tensor)
        output = layer.att(x, ctx_tensor, ctx_att_mask, output_attentions=output_attentions)
        return (layer.output(output[0], x), *output[1:])

    return {"forward": forward}



def _layer(layer: nn.Module, session: Session) -> Replacements:
    """`LxmertLayer` (language and relation layers): the attention output feeds the FFN and its residual."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False) -> tuple:
        outputs = layer.attention(hidden_states, attention_mask, output_attentions=output_attentions)
        attended = branch(session, outputs[0])
        return (layer.output(layer.intermediate(attended), attended), *outputs[1:])

    return {"forward": forward}


def _cross_layer(layer: nn.Module, session: Session) -> Replacements:
    """`LxmertXLayer`: each stream's input feeds both runs of `visual_attention` (as query, as context); each FFN
    input feeds the FFN and its residual. Its `forward` and `self_att` are the model's own."""

    def cross_att(lang_input: torch.Tensor, lang_attention_mask: torch.Tensor | None, visual_input: torch.Tensor,
                  visual_attention_mask: torch.Tensor | None, output_x_attentions: bool = False) -> tuple:
        lang, visual = branch(session, lang_input), branch(session, visual_input)
        lang_output = layer.visual_attention(lang, visual, ctx_att_mask=visual_attention_mask,
                                             output_attentions=output_x_attentions)
        visual_output = layer.visual_attention(visual, lang, ctx_att_mask=lang_attention_mask, output_attentions=False)
        return lang_output, visual_output

    def output_fc(lang_input: torch.Tensor, visual_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lang, visual = branch(session, lang_input), branch(session, visual_input)
        return layer.lang_output(layer.lang_inter(lang), lang), layer.visn_output(layer.visn_inter(visual), visual)

    return {"cross_att": cross_att, "output_fc": output_fc}



def _encoder(encoder: nn.Module, session: Session) -> Replacements:
    """`LxmertEncoder`: the embedded question enters the text stream."""
    original = encoder.forward

    def forward(lang_feats: torch.Tensor, *args, **kwargs):
        return original(session.stream_input(TEXT, lang_feats), *args, **kwargs)

    return {"forward": forward}


def _region_encoder(module: nn.Module, session: Session) -> Replacements:
    """`LxmertVisualFeatureEncoder`: its output (features and boxes encoded) enters the image stream."""
    original = module.forward
    return {"forward": lambda visual_feats, visual_pos: session.stream_input(IMAGE, original(visual_feats, visual_pos))}


def _pooler(pooler: nn.Module, session: Session) -> Replacements:
    """`LxmertPooler`: [CLS] readout, then dense and tanh (their own entries)."""
    return {"forward": lambda hidden_states: pooler.activation(pooler.dense(first_token(session, hidden_states)))}


def _unknown(module: nn.Module, _session: Session) -> Replacements:
    """A module type the authors' LXMERT has no rule for (a user's own head or wrapper)."""
    raise MissingRuleError(
        f"no relevance rule for module type {type(module).__module__}.{type(module).__name__}: the LRP-based methods "
        "explain LxmertForQuestionAnswering and LxmertForPreTraining, whose every module has the authors' rule"
    )


def rule_map(model: nn.Module) -> dict[type, ForwardFactory]:
    """Module type -> rule for every module of a transformers `LxmertForQuestionAnswering` or
    `LxmertForPreTraining` (its other heads are off the answer's path and keep their own forwards)."""
    from transformers.models.lxmert import modeling_lxmert as lx

    activations = {
        type(m.intermediate_act_fn) for m in model.modules() if isinstance(m, lx.LxmertIntermediate)
    } | {type(m.transform_act_fn) for m in model.modules() if isinstance(m, lx.LxmertPredictionHeadTransform)}
    entries: dict[type, ForwardFactory] = {
        **default_leaves(),
        nn.Module: _unknown,
        lx.LxmertForQuestionAnswering: unchanged,
        lx.LxmertForPreTraining: unchanged,
        lx.LxmertModel: unchanged,
        lx.LxmertEmbeddings: unchanged,
        lx.LxmertEncoder: _encoder,
        lx.LxmertVisualFeatureEncoder: _region_encoder,
        lx.LxmertLayer: _layer,
        lx.LxmertXLayer: _cross_layer,
        lx.LxmertSelfAttentionLayer: _self_attention_layer,
        lx.LxmertCrossAttentionLayer: _cross_attention_layer,
        lx.LxmertAttention: _attention,
        lx.LxmertAttentionOutput: post_norm_residual,
        lx.LxmertOutput: post_norm_residual,
        lx.LxmertIntermediate: unchanged,
        lx.LxmertPooler: _pooler,
        lx.LxmertVisualAnswerHead: unchanged,
        lx.LxmertPreTrainingHeads: unchanged,
        lx.LxmertLMPredictionHead: unchanged,
        lx.LxmertPredictionHeadTransform: unchanged,
        lx.LxmertVisualObjHead: unchanged,
        lx.GeLU: ACTIVATION,
        nn.CrossEntropyLoss: unchanged,  # the training losses, not run when explaining
        nn.SmoothL1Loss: unchanged,
    }
    return {**entries, **{activation: ACTIVATION for activation in activations}}
