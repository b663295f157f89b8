"""MiniMax (MiniMax-Text-01's layout: lightning attention and softmax attention under one name, a mixture of experts,
constant residual factors), a tiny random float64 model of `conv_hybrid_models.py`: AttnLRP and CP-LRP equal a
written-out float64 reference of the rules stated in docs/language_models.md, the lightning attention one token at a
time with its decayed state made explicit; input x gradient is autograd's through the model's own forward, padded
rows are the rows alone, CP-LRP conserves the logit (no bias anywhere), the attention methods are refused naming the
lightning layers, and the model is unchanged after a call and after an exception."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conv_hybrid_models import VOCAB, build
from decoder_checks import (
    ATTENTION_METHODS, assert_generation_rows_are_their_prefixes, assert_input_x_gradient_is_autograds, assert_padded_rows_are_alone,
    assert_refused_naming_the_layers, assert_unchanged_after_a_call_and_an_error,
)
from test_causal_lm import assert_close_to, batch
from test_hybrid_decoders import _identity
from test_more_decoders import SHARES, _gated, _rms, _rotated, _share

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter

MODELS: dict[str, torch.nn.Module] = {}


def model_of() -> torch.nn.Module:
    if "minimax" not in MODELS:
        MODELS["minimax"] = build("minimax")
    return MODELS["minimax"]


def inputs_of(row: str) -> dict[str, torch.Tensor]:
    """A row of `test_causal_lm.batch`, or "long": 70 tokens (more than the lightning rule's chunk of 64 positions)."""
    if row != "long":
        return batch(row)
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _lightning(attention: torch.nn.Module, x: torch.Tensor, method: str) -> torch.Tensor:
    """The lightning attention from `x` `(1, T, D)` one token at a time: `q, k, v` from `act(qkv_proj(x))` (the
    identity rule) sharing the backward (AttnLRP 1/4, 1/4, 1/2; CP-LRP the values alone); per head the state
    `S_t = exp(-lambda) S_{t-1} + k_t v_t^T`, `o_t = S_t^T q_t`; the RMSNorm over all heads (the divisor detached),
    times `sigmoid(output_gate(x))` under the gate shares, then `out_proj`."""
    query_key, value, product_value, product_gate = SHARES[method]
    heads, width, length = attention.num_attention_heads, attention.head_dim, x.shape[1]
    qkv = _identity(attention.act_fn, F.linear(x, attention.qkv_proj.weight))[0].view(length, heads, 3 * width)
    q, k, v = qkv.split(width, -1)
    q, k, v = _share(q, query_key), _share(k, query_key), _share(v, value)
    decay = torch.exp(-attention.slope_rate.flatten())[:, None, None]
    state, outputs = torch.zeros(heads, width, width, dtype=x.dtype), []
    for t in range(length):
        state = decay * state + k[t, :, :, None] * v[t, :, None, :]
        outputs.append((state * q[t, :, :, None]).sum(-2))
    o = torch.stack(outputs).flatten(1)  # (T, heads * width)
    normed = attention.norm.weight * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + attention.norm.variance_epsilon).detach()
    gated = _share(normed, product_value) * _share(_identity(torch.sigmoid, F.linear(x[0], attention.output_gate.weight)), product_gate)
    return F.linear(gated, attention.out_proj.weight)[None]


def _softmax_attention(attention: torch.nn.Module, x: torch.Tensor, rotary: torch.nn.Module, method: str) -> torch.Tensor:
    """Grouped-query causal softmax attention with RoPE from `x` `(1, T, D)`, the queries and keys sharing the backward
    with the values (AttnLRP 1/4, 1/4, 1/2; CP-LRP the values alone), the softmax its own gradient, then `o_proj`."""
    query_key, value, _, _ = SHARES[method]
    length, width = x.shape[1], attention.head_dim
    q, k, v = (F.linear(x, p.weight).view(1, length, -1, width).transpose(1, 2) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    cos, sin = rotary(x, torch.arange(length)[None])
    q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
    repeat = q.shape[1] // k.shape[1]
    q, k, v = _share(q, query_key), _share(k.repeat_interleave(repeat, 1), query_key), _share(v.repeat_interleave(repeat, 1), value)
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    probabilities = torch.softmax((q @ k.transpose(-1, -2) * attention.scaling).masked_fill(blocked, float("-inf")), -1)
    return F.linear((probabilities @ v).transpose(1, 2).flatten(2), attention.o_proj.weight)


def _mixture(mlp: torch.nn.Module, x: torch.Tensor, method: str) -> torch.Tensor:
    """The mixture of experts token by token: the model's own router (its softmax in float32, top 2, normalised),
    each chosen expert a gated MLP `down(silu(gate) * up)`, its output times its router weight under the gate shares
    (AttnLRP half each; CP-LRP the weight detached), summed."""
    _, _, product_value, product_gate = SHARES[method]
    tokens = x[0]
    _, weights, index = mlp.gate(tokens)
    experts, mixed = mlp.experts, []
    for n in range(len(tokens)):
        total = 0.0
        for slot in range(index.shape[1]):
            chosen = int(index[n, slot])
            gate_values, up = F.linear(tokens[n], experts.gate_up_proj[chosen]).chunk(2, -1)
            out = F.linear(_gated(gate_values, up, method), experts.down_proj[chosen])
            total = total + _share(out, product_value) * _share(weights[n, slot], product_gate)
        mixed.append(total)
    return torch.stack(mixed)[None]


def _written_out(model: torch.nn.Module, embeddings: torch.Tensor, method: str) -> torch.Tensor:
    """The model's next-token logits `(V,)` from its token embeddings `(1, T, D)` under the stated rules, in float64:
    each layer's branch reads the normed input, which is also its residual (`residual * alpha + branch * beta`, the
    constant factors as they are), the norms' divisors detached."""
    h, decoder = embeddings, model.model
    for layer, kind in zip(decoder.layers, model.config.layer_types):
        x = _rms(layer.input_layernorm, h)
        mixed = (_lightning(layer.self_attn, x, method) if kind == "linear_attention"
                 else _softmax_attention(layer.self_attn, x, decoder.rotary_emb, method))
        h = x * layer.attn_alpha_factor + mixed * layer.attn_beta_factor
        x = _rms(layer.post_attention_layernorm, h)
        h = x * layer.mlp_alpha_factor + _mixture(layer.mlp, x, method) * layer.mlp_beta_factor
    return F.linear(_rms(decoder.norm, h[0, -1]), model.lm_head.weight)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("row", ["single0", "single2", "long"])
def test_the_rules_equal_the_written_out_reference(method, row):
    """The explained logit's relevance at the token embeddings is the gradient x input of `_written_out`, summed over
    the width, to 1e-10 of the map, over short prompts and one longer than the lightning rule's chunk; the
    written-out logits are the model's own (its norms and router compute in float32: 1e-6)."""
    model, given = model_of(), inputs_of(row)
    explanation = relevancy.explain(model, given, method=method)
    embeddings = model.get_input_embeddings()(given["input_ids"]).detach().requires_grad_(True)
    logits = _written_out(model, embeddings, method)
    with torch.no_grad():
        own = model(**given, use_cache=False).logits[0, -1]
    assert_close_to(logits.detach(), own, f"minimax written-out logits {row}", 1e-6)
    (grad,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores[0], (embeddings * grad).sum(-1)[0].detach(), f"minimax {method} {row}", 1e-10)


def test_the_layout_reads_every_part():
    adapter = CausalLMAdapter(model_of())
    assert adapter.layout.name == "minimax" and adapter.attentionless == [0, 2] and adapter.attention_sites() == []
    assert {type(module).__name__ for module, _ in adapter.ruled} == {"MiniMaxRMSNorm", "MiniMaxLightningAttention", "MiniMaxExperts"}


def test_input_x_gradient_is_autograds_through_the_models_own_forward():
    assert_input_x_gradient_is_autograds(model_of(), "minimax")


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_padded_row_is_the_row_alone(method, padding):
    """The lightning attention sets padding to 0 after its activation (no bias: its queries, keys and values are 0
    there), so a left-padded row's state starts from the same zero as the row alone."""
    assert_padded_rows_are_alone(model_of(), method, padding, 1e-10, "minimax")


def test_cp_lrp_conserves_the_logit():
    """No bias anywhere: the embeddings get the whole explained logit on every row (the attention's probabilities,
    the routers' weights and the gates held constant; the residual factors constant)."""
    explanation = relevancy.explain(model_of(), batch("left"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-10)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_the_attention_methods_are_refused_naming_the_lightning_layers(method):
    assert_refused_naming_the_layers(model_of(), method, "minimax: its lightning-attention layers 0, 2")


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "token_ablation"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(method):
    assert_unchanged_after_a_call_and_an_error(build("minimax"), method)


@pytest.mark.parametrize("method", ["attnlrp", "input_x_gradient"])
def test_a_generations_rows_are_explain_on_their_prefixes(method):
    """`explain_generation` generates with the model's own cache (its lightning states and softmax keys and values),
    then explains each row on the whole sequence: each equals `explain` on its prefix."""
    assert_generation_rows_are_their_prefixes(model_of(), method, 1e-10)
