"""Hybrid decoders of linear and full attention (transformers' Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, tiny random
float64 models of `hybrid_models.py`): the gated DeltaNet under the rule stated in docs/methods.md equals a
written-out reference of it, one token at a time; input x gradient is autograd's through the model's own forward,
the rules explain the model's own logit, padded rows are the rows alone, CP-LRP conserves the logit (AttnLRP too
where no softmax is left: linear attention and dense MLPs alone), the attention methods are refused naming the
linear-attention layers, and the model is unchanged after a call and after an exception."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decoder_checks import (
    ATTENTION_METHODS, assert_generation_rows_are_their_prefixes, assert_input_x_gradient_is_autograds, assert_padded_rows_are_alone,
    assert_refused_naming_the_layers, assert_unchanged_after_a_call_and_an_error,
)
from hybrid_models import FAMILIES, VOCAB, build
from test_causal_lm import assert_close_to, batch

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.lrp.recurrence import gated_delta_rule

MODELS: dict[str, torch.nn.Module] = {}
#: every layer linear attention, every MLP dense: no softmax left (Qwen3-Next's fused projections, Qwen3.5's own)
LINEAR_ONLY = {"qwen3_next": dict(layer_types=["linear_attention"] * 3, num_experts=0), "qwen3_5": dict(layer_types=["linear_attention"] * 3)}
#: shares (query, written key, value, gate value, gate) of the stated rules; None: held constant
SHARES = {"attnlrp": (0.25, 0.25, 0.5, 0.5, 0.5), "cp_lrp": (None, None, 1.0, 1.0, None)}


def model_of(family: str) -> torch.nn.Module:
    if family not in MODELS:
        MODELS[family] = build(family)
    return MODELS[family]


def long_prompt(length: int = 70) -> torch.Tensor:
    """`(1, length)` token ids: longer than the delta rule's chunk of 64 positions."""
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layout_rules_every_part(family):
    adapter = CausalLMAdapter(model_of(family))
    assert adapter.layout.name == "qwen3_next" and adapter.attentionless == [0, 2] and adapter.attention_sites() == []
    ruled = {type(module).__name__.removeprefix("Qwen3Next").removeprefix("Qwen3_5Moe").removeprefix("Qwen3_5") for module, _ in adapter.ruled}
    expected = {"RMSNorm", "GatedDeltaNet", "Attention", "MLP"} | ({"SparseMoeBlock", "Experts"} if "5" not in family or "moe" in family else set())
    assert ruled == expected


def _share(x: torch.Tensor, factor: float | None) -> torch.Tensor:
    """`x` with its gradient times `factor` (None: detached)."""
    return x.detach() if factor is None else x * factor + (x * (1 - factor)).detach()


def _identity(fn, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` under the identity rule: `x * (fn(x) / x)`, the ratio detached."""
    return x * (fn(x) / x).detach()


def _norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The zero-centred RMSNorm `x / rms(x) * (1 + w)`, the divisor detached, in float32 as transformers computes it
    (also in a float64 model: its backward rounds the gradient to float32 there too)."""
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.eps).detach() * (1.0 + norm.weight.float())).type_as(x)


def _written_out(model: torch.nn.Module, ids: torch.Tensor, target: int, method: str) -> torch.Tensor:
    """A decoder of gated DeltaNet layers and dense MLPs under the stated rules, written out from the model's
    weights one token at a time: the norms' divisors detached (the L2 norms' too); the SiLUs under the identity
    rule; `beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)` and the keys in the transition detached;
    per head `S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t w_t v_t^T`, `o_t = S_t^T q_t`, the queries, the
    written keys `w` and the values sharing the backward (AttnLRP 1/4, 1/4, 1/2; CP-LRP the values alone); the
    gated norm's and the MLP's products under the gate shares (AttnLRP 1/2 each; CP-LRP the gate detached). Input x
    gradient of the target's logit at the last position, summed over the width."""
    query_share, key_share, value_share, product_value, product_gate = SHARES[method]
    embeddings = model.model.embed_tokens(ids).detach().requires_grad_(True)
    h, length = embeddings, ids.shape[1]
    for layer in model.model.layers:
        mixer, x = layer.linear_attn, _norm(layer.input_layernorm, h)
        if hasattr(mixer, "in_proj_qkvz"):
            q, k, v, z, b, a = mixer.fix_query_key_value_ordering(F.linear(x, mixer.in_proj_qkvz.weight), F.linear(x, mixer.in_proj_ba.weight))
            mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
        else:
            mixed, z, b, a = (F.linear(x, getattr(mixer, f"in_proj_{name}").weight) for name in ("qkv", "z", "b", "a"))
            z = z.unflatten(-1, (-1, mixer.head_v_dim))
        kernel = mixer.conv1d.weight[:, 0]  # (channels, k): out_t = sum_j w_j x_{t - k + 1 + j}
        padded = F.pad(mixed, (0, 0, kernel.shape[1] - 1, 0))
        mixed = _identity(F.silu, sum(kernel[:, j] * padded[:, j:j + length] for j in range(kernel.shape[1])))
        q, k, v = mixed.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], -1)
        repeat = mixer.num_v_heads // mixer.num_k_heads
        q, k = (t.unflatten(-1, (-1, mixer.head_k_dim)).repeat_interleave(repeat, 2) for t in (q, k))
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6).detach() for t in (q, k))
        q, v = _share(q / mixer.head_k_dim ** 0.5, query_share)[0], _share(v.unflatten(-1, (-1, mixer.head_v_dim)), value_share)[0]
        written, kept = _share(k, key_share)[0], k.detach()[0]
        beta = torch.sigmoid(b).detach()[0]
        g = (-torch.exp(mixer.A_log) * F.softplus(a + mixer.dt_bias)).detach()[0]
        state, outputs = torch.zeros(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, dtype=h.dtype), []
        for t in range(length):  # (heads, d_k, d_k) transitions
            erase = torch.eye(mixer.head_k_dim, dtype=h.dtype) - beta[t, :, None, None] * kept[t, :, :, None] * kept[t, :, None, :]
            state = torch.exp(g[t])[:, None, None] * erase @ state + beta[t, :, None, None] * written[t, :, :, None] * v[t, :, None, :]
            outputs.append((state * q[t, :, :, None]).sum(-2))
        o = torch.stack(outputs)[None]  # (1, T, heads, d_v)
        normed = mixer.norm.weight * o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon).detach()
        gated = _share(normed, product_value) * _share(_identity(F.silu, z), product_gate)
        h = h + F.linear(gated.flatten(2), mixer.out_proj.weight)
        mlp, x = layer.mlp, _norm(layer.post_attention_layernorm, h)
        hidden = _share(F.linear(x, mlp.up_proj.weight), product_value) * _share(_identity(F.silu, F.linear(x, mlp.gate_proj.weight)), product_gate)
        h = h + F.linear(hidden, mlp.down_proj.weight)
    logit = F.linear(_norm(model.model.norm, h)[:, -1], model.lm_head.weight)[0, target]
    (gradient,) = torch.autograd.grad(logit, embeddings)
    return (embeddings * gradient).sum(-1)


@pytest.mark.parametrize("family", LINEAR_ONLY)
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_the_delta_rule_equals_the_written_out_rules(family, method):
    """Over 70 tokens (two of the delta rule's chunks). The norms compute in float32 as the models' own (their
    gradient rounded there): the reference's norms compute so too; the delta rule's float64 arithmetic is checked
    by `test_the_chunked_delta_rule_is_the_recurrence`."""
    model = build(family, **LINEAR_ONLY[family])
    ids = long_prompt()
    explanation = relevancy.explain(model, {"input_ids": ids}, method=method, target=7)
    assert_close_to(explanation.scores, _written_out(model, ids, 7, method).detach(), f"{family} {method}", 1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_input_x_gradient_is_autograds_through_the_models_own_forward(family):
    assert_input_x_gradient_is_autograds(model_of(family), family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("inputs", ["single0", "long"])
def test_the_rules_explain_the_models_own_logit(family, method, inputs):
    """The explained logits are the model's own (transformers computes its delta rule, its norms and its routers in
    float32 even in a float64 model, hence 1e-6), over a short prompt and one longer than a chunk; the rules change
    the map."""
    model = model_of(family)
    given = batch("single0") if inputs == "single0" else {"input_ids": long_prompt(), "attention_mask": torch.ones(1, 70, dtype=torch.long)}
    explanation = relevancy.explain(model, given, method=method)
    with torch.no_grad():
        own = model(**given, use_cache=False).logits[:, -1]
    assert torch.isfinite(explanation.scores).all()
    assert_close_to(explanation.logits, own.double(), f"{family} {method} logits", 1e-6)
    plain = relevancy.explain(model, given, method="input_x_gradient").scores
    assert not torch.allclose(explanation.scores, plain, rtol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_a_padded_row_is_the_row_alone(family, method, padding):
    """The linear attention sets padding to 0 before its projections: a left-padded row's state starts from the
    same zero as the row alone. Input x gradient runs the model's own delta rule, which transformers computes in
    float32 in chunks of positions, its decays summed from each chunk's start (a left-padded row's elsewhere: 5e-8
    measured, of maps whose largest entry is 2e-3), hence 1e-4 of the map there."""
    assert_padded_rows_are_alone(model_of(family), method, padding, 1e-4 if method == "input_x_gradient" else 1e-10, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_cp_lrp_conserves_the_logit(family):
    """No bias anywhere: the embeddings get the whole explained logit on every row (the attention's probabilities,
    the routers' weights, the gates and the delta rule's transition held constant), to float32's precision: the
    models' norms compute in float32 even in a float64 model, and the backward rounds there too."""
    explanation = relevancy.explain(model_of(family), batch("left"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("family", LINEAR_ONLY)
def test_attnlrp_conserves_the_logit_without_softmax(family):
    """Linear attention and dense MLPs alone: the delta rule's shares (1/4 + 1/4 + 1/2 of an output linear in each
    of its queries, written keys and values) and the gates' halves add up, so AttnLRP conserves too (to float32's
    precision: the norms')."""
    explanation = relevancy.explain(build(family, **LINEAR_ONLY[family]), batch("left"), method="attnlrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("method", ATTENTION_METHODS)
def test_the_attention_methods_are_refused_naming_the_linear_attention_layers(method):
    assert_refused_naming_the_layers(model_of("qwen3_next"), method, "qwen3_next: its linear-attention layers 0, 2")


def test_latent_heads_are_refused_layers_are_read():
    model = model_of("qwen3_5")
    with pytest.raises(ValueError, match="linear-attention layers 0, 2"):
        relevancy.explain(model, batch("single0"), method="attnlrp", latent="heads")
    latent = relevancy.explain(model, batch("single0"), method="attnlrp", latent=True).latent
    assert latent.heads is None and latent.layers.shape[0] == 4 and latent.neurons is not None


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "token_ablation"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(method):
    assert_unchanged_after_a_call_and_an_error(build("qwen3_next"), method)


@pytest.mark.parametrize("method", ["attnlrp", "input_x_gradient"])
def test_a_generations_rows_are_explain_on_their_prefixes(method):
    """`explain_generation` generates with the model's own cache of linear and full attention, then explains each
    row on the whole sequence: each equals `explain` on its prefix (the model's own float32 delta rule under input x
    gradient: 2e-9 measured)."""
    assert_generation_rows_are_their_prefixes(model_of("qwen3_next"), method, 1e-6 if method == "input_x_gradient" else 1e-10)


def test_the_chunked_delta_rule_is_the_recurrence():
    """The delta rule chunk by chunk (several chunks, a padded last one), with written keys other than the
    transition's, equals the recurrence one position at a time in float64."""
    generator = torch.Generator().manual_seed(0)
    q, k, written = (torch.randn(2, 11, 3, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 11, 3, 5, generator=generator, dtype=torch.float64)
    g = -torch.rand(2, 11, 3, generator=generator, dtype=torch.float64) * 2
    beta = torch.rand(2, 11, 3, generator=generator, dtype=torch.float64)
    state, expected = torch.zeros(2, 3, 4, 5, dtype=torch.float64), []
    for t in range(11):
        erase = torch.eye(4, dtype=torch.float64) - beta[:, t, :, None, None] * k[:, t, :, :, None] * k[:, t, :, None, :]
        state = torch.exp(g[:, t])[..., None, None] * erase @ state + beta[:, t, :, None, None] * written[:, t, :, :, None] * v[:, t, :, None, :]
        expected.append((state * q[:, t, :, :, None]).sum(-2))
    for chunk in (1, 4, 64):
        assert torch.allclose(gated_delta_rule(q, k, v, g, beta, written, chunk=chunk), torch.stack(expected, 1), atol=1e-13, rtol=0)
