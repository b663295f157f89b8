"""The rule map of Hugging Face BERT (`BertForSequenceClassification`): which rule each module gets.

As the authors' BERT code (`BERT_explainability/modules/BERT/BERT.py` on `layers_ours`):
- self-attention: both matrix products get the halved two-operand rule; the `1/sqrt(d)` scale and the softmax
  pass relevance unchanged, the additive mask gets the add rule (its share dropped); the probabilities are
  recorded for the methods;
- post-LN residual adds (`BertSelfOutput`, `BertOutput`: `LayerNorm(dense(h) + input)`) get the add rule;
  the LayerNorms after them pass relevance unchanged; the branch split before a layer adds relevances up;
- the pooler reads [CLS] (relevance goes back to token 0), its dense layer gets the linear rule and its tanh
  passes relevance unchanged (treated as the identity); the classifier gets the linear rule;
- GELU passes relevance unchanged.
- the embeddings add `(token type + position) + word` under the add rule (the reference's order, which also
  fixes the rounding of the forward values); their LayerNorm passes relevance unchanged. The reference's full
  LRP (`generate_full_lrp`) stops at the embedding output.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from . import engine
from .engine import LINEAR, PASSTHROUGH, ForwardFactory, Replacements, Session, add, matmul, passthrough, unchanged


def _self_attention(attention: nn.Module, session: Session) -> Replacements:
    """`BertSelfAttention` (eager, explicit products): returns `(context, probabilities)` like the original."""
    head = attention.attention_head_size
    scale = math.sqrt(head)

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> tuple:
        if kwargs.get("encoder_hidden_states") is not None or kwargs.get("past_key_values") is not None:
            raise engine.MissingRuleError("relevance propagation supports BERT encoders (no cross-attention, no cache)")
        batch, tokens, _ = hidden_states.shape
        shape = (batch, tokens, -1, head)
        q = attention.query(hidden_states).view(shape).transpose(1, 2)
        k = attention.key(hidden_states).view(shape).transpose(1, 2)
        v = attention.value(hidden_states).view(shape).transpose(1, 2)

        # the reference divides by sqrt(d) (no rule), then adds the mask under the add rule (all of the relevance
        # stays with the scores: the mask's share is dropped)
        scores = passthrough(session, lambda t: t / scale, matmul(session, q, k.transpose(-2, -1)))
        if attention_mask is not None:
            scores = add(session, scores, attention_mask.to(scores.dtype))
        probabilities = passthrough(session, lambda t: t.softmax(dim=-1), scores)
        session.attentions.append(probabilities)
        context = matmul(session, probabilities, v).transpose(1, 2).reshape(batch, tokens, -1)
        return context, probabilities

    return {"forward": forward}


def _embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`BertEmbeddings` as the reference computes it: `(token type + position) + word`, both adds under the add
    rule, then LayerNorm (pass-through); relevance can so be followed to the word embeddings."""

    def forward(input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length: int = 0):
        words = embeddings.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        length = words.shape[1]
        if position_ids is None:
            position_ids = embeddings.position_ids[:, past_key_values_length: past_key_values_length + length]
        if token_type_ids is None:
            token_type_ids = torch.zeros(words.shape[:2], dtype=torch.long, device=words.device)
        types = embeddings.token_type_embeddings(token_type_ids)
        summed = add(session, add(session, types, embeddings.position_embeddings(position_ids)), words)
        return embeddings.dropout(embeddings.LayerNorm(summed))

    return {"forward": forward}


def _residual_output(module: nn.Module, session: Session) -> Replacements:
    """`BertSelfOutput` / `BertOutput`: `LayerNorm(dropout(dense(h)) + input)`, the add under the add rule."""

    def forward(hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return module.LayerNorm(add(session, module.dropout(module.dense(hidden_states)), input_tensor))

    return {"forward": forward}


def _activations() -> list[type]:
    from transformers import activations

    names = ("GELUActivation", "NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "GELUTanh",
             "PytorchGELUTanh", "AccurateGELUActivation", "MishActivation", "SiLUActivation", "LinearActivation")
    return [getattr(activations, n) for n in names if isinstance(getattr(activations, n, None), type)]


def rule_map() -> dict[type, ForwardFactory]:
    """Module type -> rule, for every module a `BertForSequenceClassification` is built from."""
    from transformers.models.bert import modeling_bert as bert

    table: dict[type, ForwardFactory] = {
        bert.BertForSequenceClassification: unchanged,
        bert.BertModel: unchanged,
        bert.BertEmbeddings: _embeddings,
        bert.BertEncoder: unchanged,
        bert.BertLayer: unchanged,
        bert.BertAttention: unchanged,
        bert.BertSelfAttention: _self_attention,
        bert.BertSelfOutput: _residual_output,
        bert.BertIntermediate: unchanged,
        bert.BertOutput: _residual_output,
        bert.BertPooler: unchanged,  # [CLS] indexing moves relevance to token 0; dense and tanh have entries
        nn.ModuleList: unchanged,
        nn.Embedding: unchanged,
        nn.Dropout: unchanged,
        nn.Linear: LINEAR,
        nn.LayerNorm: PASSTHROUGH,
        nn.Tanh: PASSTHROUGH,
        nn.GELU: PASSTHROUGH,
        nn.ReLU: PASSTHROUGH,
    }
    table.update({activation: PASSTHROUGH for activation in _activations()})
    return table
