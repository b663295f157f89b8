"""The Cohere, GLM-4.5 MoE, gpt-oss, DeepSeek-V3 and Llama 4 layouts (tiny random float64 models of `decoder_families.py`), which lxt has no map of:
the plain gradient is autograd's through the model's own forward, the explained logit is the model's own under
every rule set, a padded row is the row alone, CP-LRP conserves the logit (no Cohere, GLM, DeepSeek or Llama 4 Linear
has a bias; the norms' weights scale a linear map under the identity rule, which conserves), and the model is as it
was after a call and after an exception (test_deepseek_llama4.py: their parts, raw attention, MLA's written-out
AttnLRP)."""
from __future__ import annotations

import sys

import pytest
import torch
from decoder_checks import assert_input_x_gradient_is_autograds, assert_padded_rows_are_alone, assert_unchanged_after_a_call_and_an_error
from decoder_families import build
from test_causal_lm import assert_close_to
from test_decoder_families import batch, model_of

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter, layouts
from relevancy.families.causal_lm.layouts import ROTATIONS
from relevancy.lrp import gradient

NEW = ("cohere", "glm4_moe")
#: DeepSeek-V3 and Llama 4 (test_deepseek_llama4.py): no bias either
BIAS_FREE = (*NEW, "deepseek_v3", "llama4")
#: with gpt-oss (test_gpt_oss.py: its sinks, its clamped experts), the families these tests run on alike
MAPPED = (*BIAS_FREE, "gpt_oss")
#: the families whose router computes in float32 (transformers' own): a gradient through it differs between a
#: batch and a row alone by about 1e-7 of the map
FLOAT32_ROUTERS = ("glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("family", NEW)
def test_the_layouts_read_every_part(family):
    """Each model is taken by its own layout: Cohere's norm computed once for both branches, its logits scaled;
    GLM's dense and mixture layers, the routed and the shared experts each under their rule."""
    model = model_of(family)
    adapter = CausalLMAdapter(model)
    assert adapter.layout.name == family
    ruled = {type(module).__name__ for module, _ in adapter.ruled}
    expected = {"cohere": {"CohereLayerNorm", "CohereMLP"},
                "glm4_moe": {"Glm4MoeRMSNorm", "Glm4MoeMLP", "Glm4MoeMoE", "Glm4MoeExperts"}}[family]
    assert ruled == expected


def test_cohere_norm_is_its_forward_with_the_divisor_constant():
    """Cohere's LayerNorm (per head too) under the gradient rules: the model's own numbers (Cohere's norm computes in
    float32 even for a float64 input; the rule, as the RMSNorms', in float32 at least), and the backward of the
    centred input over a constant divisor (the identity rule), which conserves: sum(x * grad) = sum(y * upstream)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    norm = CohereLayerNorm((4, 8), eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    y = gradient.centred_norm(x, norm.weight, None, norm.variance_epsilon)
    assert_close_to(y, norm(x), "Cohere's norm", 1e-6)
    upstream = torch.randn(y.shape, generator=generator, dtype=torch.float64)
    centred = x - x.mean(-1, keepdim=True)
    composed = norm.weight * gradient.norm_identity(centred, torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5))
    (fused,), (expected,) = torch.autograd.grad(y, x, upstream), torch.autograd.grad(composed, x, upstream)
    assert torch.allclose(fused, expected, atol=1e-14)
    assert torch.allclose((x * fused).sum(), (y * upstream).sum())


@pytest.mark.parametrize("family", MAPPED)
def test_input_x_gradient_is_autograds_through_the_models_own_forward(family):
    """The plain gradient's map is input x gradient at the token embeddings through transformers' own forward."""
    explanation, logits = assert_input_x_gradient_is_autograds(model_of(family), family)
    assert torch.allclose(explanation.logits[0], logits, atol=1e-12)


@pytest.mark.parametrize("family", MAPPED)
@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_the_rules_explain_the_models_own_logit(family, method):
    """Under AttnLRP and CP-LRP the maps are finite and the explained logits are the model's own (Cohere's times its
    `logit_scale`; transformers' eager softmax, its norms and GLM's router compute in float32, hence 1e-6); the rules
    change the map."""
    model = model_of(family)
    explanation = relevancy.explain(model, batch("single0"), method=method)
    with torch.no_grad():
        own = model(**batch("single0"), use_cache=False).logits[:, -1]
    assert torch.isfinite(explanation.scores).all()
    assert_close_to(explanation.logits, own, f"{family} {method} logits", 1e-6)
    plain = relevancy.explain(model, batch("single0"), method="input_x_gradient").scores
    assert not torch.allclose(explanation.scores, plain, rtol=1e-3)


@pytest.mark.parametrize("family", MAPPED)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp"])
def test_a_padded_row_is_the_row_alone(family, method):
    """Right padding with the attention mask: each row's map is its own alone, padding 0. GLM's router runs in float32
    (transformers' own; DeepSeek's too): where the rules pass the gradient through it (not CP-LRP's, which gives the
    router weights none), autograd's own input x gradient differs between a batch and the row alone by about 1e-7.
    Llama 4 rotates its queries and keys in float32 (its complex RoPE) and its router's sigmoid too: every method
    there, autograd's own included, differs by about 1e-7."""
    float32 = (family in FLOAT32_ROUTERS and method != "cp_lrp") or family == "llama4"
    assert_padded_rows_are_alone(model_of(family), method, "right", 1e-6 if float32 else 1e-10, family)


@pytest.mark.parametrize("family", BIAS_FREE)
def test_cp_lrp_conserves_the_logit_without_biases(family):
    """No Linear of these models has a bias: CP-LRP gives the embeddings the whole explained logit on every row."""
    model = model_of(family)
    assert all(getattr(module, "bias", None) is None for module in model.modules() if isinstance(module, torch.nn.Linear))
    explanation = relevancy.explain(model, batch("left"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("family", MAPPED)
@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "lrp"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(family, method):
    """Weights, modes, hooks, forwards, attention and the modeling file's rotations (DeepSeek's on interleaved pairs,
    Llama 4's complex one) as they were, also after an exception raised inside the call (a target function that
    fails under the rules)."""
    model = build(family)
    modeling = vars(sys.modules[type(model).__module__])
    rotations = {name: modeling[name] for name in ROTATIONS if name in modeling}
    assert rotations
    assert_unchanged_after_a_call_and_an_error(model, method)
    assert all(modeling[name] is rotation for name, rotation in rotations.items())


@pytest.mark.parametrize("family", NEW)
def test_without_query_and_key_norms(family):
    """`use_qk_norm=False`: the query and key norms are absent parts and the layout still fits."""
    model = build(family, use_qk_norm=False)
    assert CausalLMAdapter(model).layout.name == family
    explanation = relevancy.explain(model, batch("single0"), method="cp_lrp")
    assert torch.allclose(explanation.relevance_total, torch.ones(1, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("family", NEW)
def test_the_rotation_is_the_models_own(family):
    """Cohere rotates interleaved pairs: not Llama's rotation, so the gradient rules run the modeling file's own
    `apply_rotary_pos_emb`. GLM's file has Llama's, which the rules swap for its fused twin; the model rotates half of
    each head, which the twin hands back to the file's own, bit for bit."""
    model = model_of(family)
    modeling = sys.modules[type(model).__module__]
    attention = model.model.layers[0].self_attn
    replaced = layouts.rotation_replacements(attention)
    ids = batch("single0")["input_ids"]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(model.get_input_embeddings()(ids), torch.arange(ids.shape[1])[None])
    if family == "cohere":
        assert replaced == [] and cos.shape[-1] == attention.head_dim
        return
    ((owner, name, twin),) = replaced
    assert (owner, name) == (modeling, "apply_rotary_pos_emb") and cos.shape[-1] == attention.head_dim // 2
    q, k = (torch.randn(1, heads, ids.shape[1], attention.head_dim, dtype=torch.float64) for heads in (4, 2))
    assert all(torch.equal(a, b) for a, b in zip(twin(q, k, cos, sin), modeling.apply_rotary_pos_emb(q, k, cos, sin)))
