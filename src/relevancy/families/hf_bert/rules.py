"""Rule maps of the Hugging Face BERT family (`*ForSequenceClassification`): which rule each module gets.

BERT follows the authors' BERT code (`BERT_explainability/modules/BERT/BERT.py` on `layers_ours`); RoBERTa
(XLM-R, CamemBERT) and DistilBERT, which the authors did not cover, get the same rules on their own modules:
- self-attention: both matrix products get the halved two-operand rule; the `1/sqrt(d)` scale and the softmax
  pass relevance unchanged, the additive mask gets the add rule (its share dropped); the probabilities are
  recorded for the methods;
- post-LN residual adds (`LayerNorm(dense(h) + input)`) get the add rule; the LayerNorms after them pass
  relevance unchanged; the branch split before a layer adds relevances up;
- the head reads [CLS] (relevance goes back to token 0); its dense layers get the linear rule, its tanh
  (BERT pooler, RoBERTa head) passes relevance unchanged (treated as the identity), so does DistilBERT's ReLU
  (its gradient already is the identity wherever the input carries relevance);
- GELU passes relevance unchanged.
- the embeddings add their parts under the add rule, in the order the model adds them (BERT: the reference's
  `(token type + position) + word`, which also fixes the rounding of the forward values; RoBERTa:
  `(word + token type) + position`; DistilBERT: `word + position`); their LayerNorm passes relevance
  unchanged. The reference's full LRP (`generate_full_lrp`) stops at the embedding output.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...lrp import engine
from ...lrp.attention import AttentionStyle, attend
from ...lrp.engine import ForwardFactory, Replacements, Session, add, branch, by_type, first_token, passthrough, unchanged
from ..hf_attention import post_norm_residual, transformers_leaves

# the authors' BERT divides the products by sqrt(d) and adds the mask under the add rule (the mask's share dropped)
_BERT_ATTENTION = AttentionStyle(scale="divide", mask="add")

def _self_attention(attention: nn.Module, session: Session) -> Replacements:
    """`BertSelfAttention` and RoBERTa's: projections shaped into heads for the shared attention; returns
    `(context, probabilities)`."""
    return _attention_forward(session, attention.attention_head_size, attention.query, attention.key, attention.value)


def _distilbert_attention(attention: nn.Module, session: Session) -> Replacements:
    """`DistilBertSelfAttention`: as BERT's, with the output projection inside."""
    return _attention_forward(session, attention.attention_head_size, attention.q_lin, attention.k_lin,
                              attention.v_lin, attention.out_lin)


def _attention_forward(session: Session, head: int, query: nn.Module, key: nn.Module, value: nn.Module,
                       output: nn.Module | None = None) -> Replacements:
    scale = math.sqrt(head)

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> tuple:
        if kwargs.get("encoder_hidden_states") is not None or kwargs.get("past_key_values") is not None:
            raise engine.MissingRuleError("relevance propagation supports encoders (no cross-attention, no cache)")
        batch, tokens, _ = hidden_states.shape
        shape = (batch, tokens, -1, head)
        hidden_states = branch(session, hidden_states)  # feeds the query, key and value projections
        q = query(hidden_states).view(shape).transpose(1, 2)
        k = key(hidden_states).view(shape).transpose(1, 2)
        v = value(hidden_states).view(shape).transpose(1, 2)
        context, probabilities = attend(session, q, k, v, scale, attention_mask, style=_BERT_ATTENTION)
        context = context.transpose(1, 2).reshape(batch, tokens, -1)
        return (context if output is None else output(context)), probabilities

    return {"forward": forward}


def _bert_embeddings(embeddings: nn.Module, session: Session) -> Replacements:
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


def _branched_input(module: nn.Module, session: Session) -> Replacements:
    """`BertAttention`: its input feeds the self-attention and the residual add."""
    original = module.forward

    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        return original(branch(session, hidden_states), *args, **kwargs)

    return {"forward": forward}


def _layer(layer: nn.Module, session: Session) -> Replacements:
    """`BertLayer`: the attention output feeds the feed-forward block and its residual add."""
    original = layer.feed_forward_chunk
    return {"feed_forward_chunk": lambda attention_output: original(branch(session, attention_output))}


def _pooler(pooler: nn.Module, session: Session) -> Replacements:
    """`BertPooler`: [CLS] readout, then dense and tanh (their own entries)."""
    return {"forward": lambda hidden_states: pooler.activation(pooler.dense(first_token(session, hidden_states)))}



def _roberta_embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """`RobertaEmbeddings`: `(word + token type) + position` under the add rule, positions counted from the
    padding index as the model does; then LayerNorm (pass-through)."""

    def forward(input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length: int = 0):
        words = embeddings.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = (embeddings.create_position_ids_from_input_ids(input_ids, embeddings.padding_idx, past_key_values_length)
                            if input_ids is not None
                            else embeddings.create_position_ids_from_inputs_embeds(inputs_embeds, embeddings.padding_idx))
        if token_type_ids is None:
            token_type_ids = torch.zeros(words.shape[:2], dtype=torch.long, device=words.device)
        summed = add(session, add(session, words, embeddings.token_type_embeddings(token_type_ids)),
                     embeddings.position_embeddings(position_ids))
        return embeddings.dropout(embeddings.LayerNorm(summed))

    return {"forward": forward}


def _distilbert_embeddings(embeddings: nn.Module, session: Session) -> Replacements:
    """DistilBERT `Embeddings`: `word + position` under the add rule, then LayerNorm (pass-through)."""

    def forward(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None, position_ids=None):
        words = embeddings.word_embeddings(input_ids) if input_ids is not None else inputs_embeds
        if position_ids is None:
            position_ids = embeddings.position_ids[:, : words.shape[1]]
        summed = add(session, words, embeddings.position_embeddings(position_ids))
        return embeddings.dropout(embeddings.LayerNorm(summed))

    return {"forward": forward}


def _roberta_head(head: nn.Module, session: Session) -> Replacements:
    """`RobertaClassificationHead`: dense, tanh (a function call here, pass-through), out_proj on `<s>`."""

    def forward(features: torch.Tensor, **_kwargs) -> torch.Tensor:
        hidden = passthrough(session, torch.tanh, head.dense(head.dropout(first_token(session, features))))
        return head.out_proj(head.dropout(hidden))

    return {"forward": forward}


def _distilbert_block(block: nn.Module, session: Session) -> Replacements:
    """DistilBERT `TransformerBlock`: both post-LN residual adds under the add rule."""

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden_states = branch(session, hidden_states)
        attended, _ = block.attention(hidden_states, attention_mask=attention_mask, **kwargs)
        attended = branch(session, block.sa_layer_norm(add(session, attended, hidden_states)))
        return block.output_layer_norm(add(session, block.ffn(attended), attended))

    return {"forward": forward}


def _encoder_rules(model: nn.Module, encoder: nn.Module, embeddings: ForwardFactory) -> dict[type, ForwardFactory]:
    """What BERT and RoBERTa-style encoders share, keyed by the types of the model's own modules (any subclass or
    attention variant the model was built with): post-LN layers of self-attention and feed-forward."""
    layers = list(encoder.encoder.layer)
    return {
        **transformers_leaves(),
        **by_type([model], unchanged), **by_type([encoder], unchanged), **by_type([encoder.embeddings], embeddings),
        **by_type([encoder.encoder], unchanged), **by_type(layers, _layer),
        **by_type([layer.attention for layer in layers], _branched_input),
        **by_type([layer.attention.self for layer in layers], _self_attention),
        **by_type([layer.attention.output for layer in layers], post_norm_residual),
        **by_type([layer.intermediate for layer in layers], unchanged),
        **by_type([layer.output for layer in layers], post_norm_residual),
    }


def bert_rules(model: nn.Module) -> dict[type, ForwardFactory]:
    """`BertForSequenceClassification`: the reference's embeddings, [CLS] read by the pooler."""
    return {**_encoder_rules(model, model.bert, _bert_embeddings), **by_type([model.bert.pooler], _pooler)}


def roberta_rules(model: nn.Module) -> dict[type, ForwardFactory]:
    """RoBERTa, XLM-R, CamemBERT classifiers: their embeddings, `<s>` read by the classification head."""
    return {**_encoder_rules(model, model.roberta, _roberta_embeddings), **by_type([model.classifier], _roberta_head)}


def distilbert_rules(model: nn.Module) -> dict[type, ForwardFactory]:
    """`DistilBertForSequenceClassification`: word + position embeddings, blocks with both residual adds."""
    body = model.distilbert
    blocks = list(body.transformer.layer)
    return {
        **transformers_leaves(),
        **by_type([model], unchanged), **by_type([body], unchanged), **by_type([body.embeddings], _distilbert_embeddings),
        **by_type([body.transformer], unchanged), **by_type(blocks, _distilbert_block),
        **by_type([block.attention for block in blocks], _distilbert_attention),
        **by_type([block.ffn for block in blocks], unchanged),
    }
