"""HunYuan-Dense V1 (`decoder_families.py`) and LFM2's hybrid of attention and gated short convolutions
(`conv_hybrid_models.py`), tiny random float64 models: AttnLRP and CP-LRP equal a written-out float64 reference of
the stated rules (docs/language_models.md) to 1e-10, input x gradient is autograd's through the model's own forward,
padded rows are the rows alone, CP-LRP conserves the logit (no bias anywhere), LFM2's attention methods are refused
naming its convolution layers, and the model is unchanged after a call and after an exception."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from conv_hybrid_models import build as build_conv_hybrid
from decoder_checks import (
    ATTENTION_METHODS, assert_input_x_gradient_is_autograds, assert_padded_rows_are_alone, assert_refused_naming_the_layers,
    assert_unchanged_after_a_call_and_an_error,
)
from decoder_families import build as build_decoder
from test_causal_lm import assert_close_to, batch

import relevancy
from relevancy.families.base import UnsupportedModelError
from relevancy.families.causal_lm import CausalLMAdapter

#: shares (query and key, value, gate product's value, its gate) of the stated rules; None: held constant
SHARES = {"attnlrp": (0.25, 0.5, 0.5, 0.5), "cp_lrp": (None, 1.0, 1.0, None)}
BUILDS = {"hunyuan_v1_dense": build_decoder, "lfm2": build_conv_hybrid}
MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in MODELS:
        MODELS[family] = BUILDS[family](family)
    return MODELS[family]


def _share(x: torch.Tensor, factor: float | None) -> torch.Tensor:
    """`x` with its gradient times `factor` (None: detached)."""
    return x.detach() if factor is None else x * factor + (x * (1 - factor)).detach()


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm `w * x / rms(x)`, the divisor detached (the identity rule)."""
    return norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on halves `(B, H, T, d)`: a linear map (its gradient passes relevance coordinate by coordinate)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def _attention(attention: torch.nn.Module, x: torch.Tensor, output: torch.Tensor, query_norm: torch.nn.Module,
               key_norm: torch.nn.Module, rotate_first: bool, rotary: torch.nn.Module, method: str) -> torch.Tensor:
    """Grouped-query causal softmax attention from `x` `(1, T, D)`, each head's query and key normed (`rotate_first`:
    after the rotation, HunYuan; before it, LFM2), the queries and keys sharing the backward with the values as
    the rules state (AttnLRP 1/4, 1/4, 1/2; CP-LRP the values alone), the softmax its own gradient, then `output`."""
    query_key, value, _, _ = SHARES[method]
    length, width = x.shape[1], attention.head_dim
    q, k, v = (F.linear(x, p.weight).view(1, length, -1, width).transpose(1, 2) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    cos, sin = rotary(x, torch.arange(length)[None])
    if rotate_first:
        q, k = _rms(query_norm, _rotated(q, cos, sin)), _rms(key_norm, _rotated(k, cos, sin))
    else:
        q, k = _rotated(_rms(query_norm, q), cos, sin), _rotated(_rms(key_norm, k), cos, sin)
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    q, k, v = _share(q, query_key), _share(k, query_key), _share(v, value)
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    probabilities = torch.softmax((q @ k.transpose(-1, -2) * attention.scaling).masked_fill(blocked, float("-inf")), -1)
    return F.linear((probabilities @ v).transpose(1, 2).flatten(2), output.weight)


def _gated(act_input: torch.Tensor, up: torch.Tensor, method: str) -> torch.Tensor:
    """`silu(g) * u`, the SiLU under the identity rule, the product under the gate shares (AttnLRP half each; CP-LRP
    the gate detached)."""
    _, _, product_value, product_gate = SHARES[method]
    return _share(up, product_value) * _share(act_input * (F.silu(act_input) / act_input).detach(), product_gate)


def _short_convolution(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`out_proj(C * conv(B * x))`, `B`, `C` detached, the causal depth-wise convolution written out position by
    position: `conv(u)_t = sum_j w_j u_{t - k + 1 + j}`."""
    b, c, u = F.linear(x, block.in_proj.weight).chunk(3, -1)
    u, kernel, length = b.detach() * u, block.conv.weight[:, 0], x.shape[1]
    padded = F.pad(u, (0, 0, kernel.shape[1] - 1, 0))
    convolved = sum(kernel[:, j] * padded[:, j:j + length] for j in range(kernel.shape[1]))
    return F.linear(c.detach() * convolved, block.out_proj.weight)


def _written_out(family: str, model: torch.nn.Module, embeddings: torch.Tensor, method: str) -> torch.Tensor:
    """The model's next-token logits `(V,)` from its token embeddings `(1, T, D)` under the stated rules, in float64:
    HunYuan's pre-norm layers (attention, then the gated MLP `down(silu(gate) * up)`), LFM2's (attention or the
    short convolution, then `w2(silu(w1) * w3)`), the norms' divisors detached."""
    h, decoder = embeddings, model.model
    for layer in decoder.layers:
        if family == "hunyuan_v1_dense":
            attention, mlp = layer.self_attn, layer.mlp
            h = h + _attention(attention, _rms(layer.input_layernorm, h), attention.o_proj, attention.query_layernorm,
                               attention.key_layernorm, True, decoder.rotary_emb, method)
            x = _rms(layer.post_attention_layernorm, h)
            h = h + F.linear(_gated(F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight), method), mlp.down_proj.weight)
            continue
        x = _rms(layer.operator_norm, h)
        if hasattr(layer, "conv"):
            h = h + _short_convolution(layer.conv, x)
        else:
            attention = layer.self_attn
            h = h + _attention(attention, x, attention.out_proj, attention.q_layernorm, attention.k_layernorm, False,
                               decoder.rotary_emb, method)
        x, mlp = _rms(layer.ffn_norm, h), layer.feed_forward
        h = h + F.linear(_gated(F.linear(x, mlp.w1.weight), F.linear(x, mlp.w3.weight), method), mlp.w2.weight)
    final = decoder.norm if family == "hunyuan_v1_dense" else decoder.embedding_norm
    return F.linear(_rms(final, h[0, -1]), model.lm_head.weight)


@pytest.mark.parametrize("family", BUILDS)
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("row", ["single0", "single2"])
def test_the_rules_equal_the_written_out_reference(family, method, row):
    """The explained logit's relevance at the token embeddings is the gradient x input of `_written_out`, summed over
    the width, to 1e-10 of the map; the written-out logits are the model's own (its norms and softmax compute in
    float32: 1e-6)."""
    model = model_of(family)
    explanation = relevancy.explain(model, batch(row), method=method)
    embeddings = model.get_input_embeddings()(batch(row)["input_ids"]).detach().requires_grad_(True)
    logits = _written_out(family, model, embeddings, method)
    with torch.no_grad():
        own = model(**batch(row), use_cache=False).logits[0, -1]
    assert_close_to(logits.detach(), own, f"{family} written-out logits", 1e-6)
    (grad,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores[0], (embeddings * grad).sum(-1)[0].detach(), f"{family} {method}", 1e-10)


def test_the_layouts_read_every_part():
    hunyuan, lfm2 = CausalLMAdapter(model_of("hunyuan_v1_dense")), CausalLMAdapter(model_of("lfm2"))
    assert hunyuan.layout.name == "hunyuan_v1_dense" and "lrp" in hunyuan.methods and len(hunyuan.attention_sites()) == 2
    assert {type(module).__name__ for module, _ in hunyuan.ruled} == {"HunYuanDenseV1RMSNorm", "HunYuanDenseV1MLP"}
    assert lfm2.layout.name == "lfm2" and lfm2.attentionless == [0, 2] and lfm2.attention_sites() == []
    assert {type(module).__name__ for module, _ in lfm2.ruled} == {"Lfm2RMSNorm", "Lfm2ShortConv", "Lfm2MLP"}


def test_an_unknown_decoder_is_refused_naming_the_mapped_classes():
    """BLOOM (no layout maps it) is refused; the refusal lists the decoder classes, the new ones among them."""
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4)).eval()
    with pytest.raises(UnsupportedModelError, match="fits no decoder layout") as refusal:
        relevancy.explain(model, batch("single0"), method="attnlrp")
    assert all(name in str(refusal.value) for name in ("HunYuanDenseV1ForCausalLM", "Lfm2ForCausalLM", "MiniMaxForCausalLM"))


@pytest.mark.parametrize("family", BUILDS)
def test_input_x_gradient_is_autograds_through_the_models_own_forward(family):
    assert_input_x_gradient_is_autograds(model_of(family), family)


@pytest.mark.parametrize("family", BUILDS)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_padded_row_is_the_row_alone(family, method, padding):
    """The short convolution sets padding to 0 before its projection (no bias: its gates and what it carries are 0
    there), so a left-padded row's convolution reads the same zeros as the row alone."""
    assert_padded_rows_are_alone(model_of(family), method, padding, 1e-10, family)


@pytest.mark.parametrize("family", BUILDS)
def test_cp_lrp_conserves_the_logit(family):
    """No bias anywhere: the embeddings get the whole explained logit on every row (the probabilities, the gates and
    the convolution's `B`, `C` held constant)."""
    explanation = relevancy.explain(model_of(family), batch("left"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-10)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_lfm2_attention_methods_are_refused_naming_the_convolution_layers(method):
    assert_refused_naming_the_layers(model_of("lfm2"), method, "lfm2: its short-convolution layers 0, 2")


@pytest.mark.parametrize("family", BUILDS)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "token_ablation"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(family, method):
    assert_unchanged_after_a_call_and_an_error(BUILDS[family](family), method)


def test_hunyuan_explicit_lrp_conserves_the_logit():
    """The seeds' rules on HunYuan: relevance rotated into the query and key norms after RoPE and through them
    conserves the logit on every row (no bias)."""
    explanation = relevancy.explain(model_of("hunyuan_v1_dense"), batch("left"), method="lrp", rules="paper")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)
