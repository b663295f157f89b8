"""DeepSeek-V3 (multi-head latent attention; Kimi K2's layout) and Llama 4's text decoder (tiny random float64 models
of `decoder_families.py`), which lxt has no map of: each taken by its own layout with every part under its rule,
raw attention the model's own probabilities, and AttnLRP on one DeepSeek layer equal to the same computation written
out by hand with the rules stated. The plain gradient, the model's own logits, padding, CP-LRP's conservation and
the model unchanged: test_new_decoder_layouts.py; the seeds' LRP methods: test_decoder_families.py."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from decoder_families import build
from test_causal_lm import assert_close_to
from test_decoder_families import batch, model_of

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.lrp import gradient
from relevancy.lrp.rule_sets import ATTNLRP

FAMILIES = ("deepseek_v3", "llama4")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layouts_read_every_part(family):
    """DeepSeek's latent attention's two norms, its dense layer and its mixture (routed and shared experts); Llama 4's
    chunked layer (chunks shorter than the prompt) with RoPE and the query and key norm, its global layer without
    either, its mixture and its dense MLP of another width: each under its rule."""
    model = model_of(family)
    adapter = CausalLMAdapter(model)
    assert adapter.layout.name == family
    ruled = {type(module).__name__ for module, _ in adapter.ruled}
    expected = {"deepseek_v3": {"DeepseekV3RMSNorm", "DeepseekV3MLP", "DeepseekV3MoE", "DeepseekV3Experts"},
                "llama4": {"Llama4TextRMSNorm", "Llama4TextL2Norm", "Llama4TextAttention", "Llama4TextMLP", "Llama4TextMoe",
                           "Llama4TextExperts"}}[family]
    assert ruled == expected
    layers = model.model.layers
    if family == "deepseek_v3":
        attention = layers[0].self_attn
        assert attention.q_a_proj is not None and attention.qk_head_dim != attention.v_head_dim and model.config.rope_interleave
        assert attention.scaling != attention.qk_head_dim ** -0.5  # yarn's mscale
        assert sum(module is layer.self_attn.kv_a_layernorm for module, _ in adapter.ruled for layer in layers) == 2
    else:
        assert model.config.layer_types == ["chunked_attention", "full_attention"]
        assert model.config.attention_chunk_size < batch("single0")["input_ids"].shape[1]
        assert hasattr(layers[0].self_attn, "qk_norm") and not hasattr(layers[1].self_attn, "qk_norm")
        assert layers[0].is_moe_layer and not layers[1].is_moe_layer


@pytest.mark.parametrize("options", [{"q_lora_rank": None}, {"rope_interleave": False}])
@pytest.mark.parametrize("method,rules", [("cp_lrp", None), ("lrp", "paper")])
def test_deepseek_variants(options, method, rules):
    """`q_lora_rank=None`: the queries come from one `q_proj` and the query norm is absent; `rope_interleave=False`:
    the halves rotated (Llama's rotation, which the gradient rules run as their fused twin). Both are taken by the
    layout, and CP-LRP and the seeds' rules conserve the logit on every row."""
    model = build("deepseek_v3", **options)
    attention = model.model.layers[0].self_attn
    assert CausalLMAdapter(model).layout.name == "deepseek_v3"
    assert (attention.q_proj is not None) == ("q_lora_rank" in options)
    explanation = relevancy.explain(model, batch("left"), method=method, **({"rules": rules} if rules else {}))
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_attention_reads_the_models_own_probabilities(family):
    """The last layer's probabilities (Llama 4's global layer; DeepSeek's latent heads), averaged over the heads,
    at the last token: raw attention's map (transformers' eager attention returns them)."""
    model = build(family)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        own = model(**batch("single0"), use_cache=False, output_attentions=True).attentions[-1]
    explanation = relevancy.explain(model, batch("single0"), method="raw_attention")
    assert_close_to(explanation.scores[0], own.mean(1)[0, -1], f"{family} raw attention", 1e-6)  # their softmax: float32


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with its divisor detached: the identity rule (relevance passes as through a fixed scaling)."""
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach())


def _uniform(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a * b` (exactly: `(ab + ab) / 2`) whose gradient gives each factor half of the product's relevance."""
    return 0.5 * (a * b.detach() + a.detach() * b)


def _written_out_latent_attention(model: torch.nn.Module, embeddings: torch.Tensor) -> torch.Tensor:
    """The one-layer DeepSeek's explained logit from its token embeddings, by hand in float64 under AttnLRP:
    RMSNorms (the layer's, the latent attention's two, the final one) with their divisor detached; the low-rank
    projections, `kv_b_proj`, `o_proj`, the MLP's and the head's as plain products (their gradient: the epsilon rule);
    the rotation of the queries' and the shared key's rotated parts the file's own (a linear map: its gradient);
    queries and keys a quarter of their relevance, values half (`gradient.share`: the uniform rule on `q k^T` and on
    `probabilities @ v`, whose first factor is the softmax of the former); the softmax its own gradient, the causal
    mask and the scale (yarn's `mscale` in it) constants; the MLP's SiLU under the identity rule (`silu(g) / g`
    detached) and its product under the uniform rule."""
    modeling = sys.modules[type(model).__module__]
    layer, config = model.model.layers[0], model.config
    attention, eps = layer.self_attn, config.rms_norm_eps
    length = embeddings.shape[1]
    heads, nope, rope, value, rank = (attention.num_heads, attention.qk_nope_head_dim, attention.qk_rope_head_dim,
                                      attention.v_head_dim, attention.kv_lora_rank)
    x = _rms(embeddings, layer.input_layernorm.weight, eps)
    queries = F.linear(_rms(F.linear(x, attention.q_a_proj.weight), attention.q_a_layernorm.weight, eps), attention.q_b_proj.weight)
    queries = queries.view(1, length, heads, nope + rope).transpose(1, 2)
    latent, k_rot = F.linear(x, attention.kv_a_proj_with_mqa.weight).split([rank, rope], dim=-1)
    kv = F.linear(_rms(latent, attention.kv_a_layernorm.weight, eps), attention.kv_b_proj.weight)
    k_nope, v = kv.view(1, length, heads, nope + value).transpose(1, 2).split([nope, value], dim=-1)
    cos, sin = model.model.rotary_emb(embeddings, torch.arange(length)[None])
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(queries[..., nope:], k_rot[:, None], cos, sin)
    q = torch.cat([queries[..., :nope], q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, heads, -1, -1)], dim=-1)
    q, k, v = gradient.share(q, 0.25), gradient.share(k, 0.25), gradient.share(v, 0.5)
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    scores = (q * attention.scaling) @ k.transpose(-2, -1)
    probabilities = torch.softmax(scores.masked_fill(blocked, torch.finfo(scores.dtype).min), dim=-1)
    context = (probabilities @ v).transpose(1, 2).reshape(1, length, heads * value)
    h = embeddings + F.linear(context, attention.o_proj.weight)
    mlp = layer.mlp
    g = F.linear(_rms(h, layer.post_attention_layernorm.weight, eps), mlp.gate_proj.weight)
    u = F.linear(_rms(h, layer.post_attention_layernorm.weight, eps), mlp.up_proj.weight)
    activated = g * (F.silu(g) / g).detach()
    h = h + F.linear(_uniform(activated, u), mlp.down_proj.weight)
    return F.linear(_rms(h[0, -1], model.model.norm.weight, eps), model.lm_head.weight)


def test_latent_attention_under_attnlrp_is_the_written_out_rules():
    """AttnLRP's relevance at the input of one DeepSeek layer (a one-layer model: its token embeddings) is the
    gradient x input of `_written_out_latent_attention`, summed over the width, to 1e-10; the written-out logit is
    the model's own (its norms and softmax in float32: 1e-6)."""
    model = build("deepseek_v3", num_hidden_layers=1)
    ids = batch("single0")["input_ids"]
    explanation = relevancy.explain(model, batch("single0"), method="attnlrp")
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    logits = _written_out_latent_attention(model, embeddings)
    assert_close_to(logits, explanation.logits[0], "the written-out logits", 1e-6)
    (grad,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores[0], (embeddings * grad).sum(-1)[0].detach(), "DeepSeek AttnLRP", 1e-10)
    assert ATTNLRP.query_key == 0.25 and ATTNLRP.value == 0.5 and ATTNLRP.gate == (0.5, 0.5)


def test_llama4_query_temperature_passes_relevance_in_the_explicit_pass():
    """Llama 4's global layer scales its queries by a factor above 1 from the second position on (floor_scale 2); the
    seeds' rules pass relevance through it unchanged, so they conserve the logit on every row, as without it."""
    model = model_of("llama4")
    attention = model.model.layers[1].self_attn
    assert attention.attn_temperature_tuning and not attention.use_rope and attention.floor_scale < 7
    explanation = relevancy.explain(model, batch("left"), method="lrp", rules="paper")
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)
    assert attention.attn_temperature_tuning and "forward" not in vars(attention.q_proj)
