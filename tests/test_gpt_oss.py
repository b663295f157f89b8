"""gpt-oss (a tiny random float64 `GptOssForCausalLM` of `decoder_families.py`), which lxt has no map of: attention
with a sink per head, a sliding-window layer and a full one, a mixture of experts with biases and a clamped SwiGLU.
The sinks' softmax is the model's own, the plain gradient is autograd's through the model's own forward, the
explained logit is the model's own under every rule set, a padded row is the row alone, the sinks take no relevance
(the seeds' rules and CP-LRP conserve where nothing else keeps a share), raw attention reads the model's own
probabilities, and the model is as it was after a call and after an exception."""
from __future__ import annotations

import sys

import pytest
import torch
from bimodal_golden import assert_same, snapshot
from decoder_families import build
from test_causal_lm import assert_close_to
from test_decoder_families import batch, model_of

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.lrp.attention import attend
from relevancy.lrp.rule_sets import ATTNLRP


def test_the_layout_reads_every_part():
    """The sliding layer's window is shorter than the prompts; the norms and the experts run their rules."""
    model = model_of("gpt_oss")
    adapter = CausalLMAdapter(model)
    assert adapter.layout.name == "gpt_oss"
    assert {type(module).__name__ for module, _ in adapter.ruled} == {"GptOssRMSNorm", "GptOssExperts"}
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert model.config.sliding_window < batch("single0")["input_ids"].shape[1]


def test_the_sinks_softmax_is_the_models_own():
    """`attend` with sinks gives transformers' eager gpt-oss attention (grouped heads, a sliding mask), and under a
    gradient rule set the sinks, held constant, get no gradient."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 5, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2))
    sinks = torch.nn.Parameter(torch.randn(4, generator=generator, dtype=torch.float64))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-3)  # a window of 3
    mask = torch.zeros(5, 5, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)[None, None]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, 2
    module.eval()
    own, own_weights = eager_attention_forward(module, q, k, v, mask, scaling=8 ** -0.5)
    context, weights = attend(None, q, k, v, 8 ** -0.5, mask, sinks=sinks)
    assert torch.allclose(context.transpose(1, 2), own, atol=1e-14) and torch.allclose(weights, own_weights, atol=1e-14)
    assert (weights.sum(-1) < 1).all()
    from relevancy.lrp.engine import Session

    q.requires_grad_(True)
    context, _ = attend(Session(ATTNLRP), q, k, v, 8 ** -0.5, mask, sinks=sinks, probabilities=False)
    context.sum().backward()
    assert sinks.grad is None and q.grad is not None and torch.isfinite(q.grad).all()


def test_input_x_gradient_is_autograds_through_the_models_own_forward():
    """The plain gradient's map is input x gradient at the token embeddings through transformers' own forward."""
    model = model_of("gpt_oss")
    ids, mask = batch("single0").values()
    explanation = relevancy.explain(model, batch("single0"), method="input_x_gradient")
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, attention_mask=mask, use_cache=False).logits[0, -1]
    (gradient,) = torch.autograd.grad(logits[explanation.target[0]], embeddings)
    assert_close_to(explanation.scores, (embeddings * gradient).sum(-1).detach(), "gpt-oss input x gradient", 1e-10)
    assert torch.allclose(explanation.logits[0], logits.detach(), atol=1e-12)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "lrp"])
def test_the_rules_explain_the_models_own_logit(method):
    """Under AttnLRP, CP-LRP and the seeds' LRP the maps are finite and the explained logits are the model's own
    (its norms compute in float32, hence 1e-6); the rules change the map."""
    model = model_of("gpt_oss")
    explanation = relevancy.explain(model, batch("single0"), method=method)
    with torch.no_grad():
        own = model(**batch("single0"), use_cache=False).logits[:, -1]
    assert torch.isfinite(explanation.scores).all()
    assert_close_to(explanation.logits, own, f"gpt-oss {method} logits", 1e-6)
    plain = relevancy.explain(model, batch("single0"), method="input_x_gradient").scores
    assert not torch.allclose(explanation.scores, plain, rtol=1e-3)


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "lrp"])
def test_a_padded_row_is_the_row_alone(method):
    """Right padding with the attention mask (the sliding window over real tokens only): each row's map is its own
    alone, padding 0."""
    model = model_of("gpt_oss")
    batched = relevancy.explain(model, batch("right"), method=method).scores
    mask = batch("right")["attention_mask"].bool()
    assert (batched[~mask] == 0).all()
    for row in range(len(mask)):
        single = relevancy.explain(model, batch(f"single{row}"), method=method).scores[0]
        assert_close_to(batched[row][mask[row]], single, f"gpt-oss {method} row {row}", 1e-10)


@pytest.mark.parametrize("method,options", [("cp_lrp", {}), ("lrp", {"rules": "paper"}), ("transformer_attribution", {})])
def test_the_sinks_take_no_relevance(method, options):
    """The sinks keep none of the explained logit: without attention biases and with clamps that cut nothing, the
    seeds' rules conserve it on every row; so does CP-LRP where the experts add nothing (their biases and the
    SwiGLU's `+ 1` keep a share under a gradient rule set)."""
    model = build("gpt_oss", attention_bias=False, swiglu_limit=100.0)
    if method == "cp_lrp":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.down_proj.zero_()
                layer.mlp.experts.down_proj_bias.zero_()
    explanation = relevancy.explain(model, batch("left"), method=method, **options)
    assert torch.allclose(explanation.relevance_total, torch.ones(3, dtype=torch.float64), atol=1e-6)


def test_raw_attention_reads_the_models_own_probabilities():
    """The last layer's probabilities over the real keys (the sink's share dropped, as transformers returns them),
    averaged over the heads, at the last token: raw attention's map."""
    model = model_of("gpt_oss")
    with torch.no_grad():
        own = model(**batch("single0"), use_cache=False, output_attentions=True).attentions[-1]
    assert (own.sum(-1) < 1).all()
    explanation = relevancy.explain(model, batch("single0"), method="raw_attention")
    assert_close_to(explanation.scores[0], own.mean(1)[0, -1], "gpt-oss raw attention", 1e-10)


@pytest.mark.parametrize("method", ["input_x_gradient", "attnlrp", "cp_lrp", "lrp"])
def test_the_model_is_unchanged_after_a_call_and_after_an_error(method):
    """Weights, modes, hooks, forwards, attention and the modeling file's RoPE as they were, also after an exception
    raised inside the call (a target function that fails under the rules)."""
    model = build("gpt_oss")
    before, modeling = snapshot(model), vars(sys.modules[type(model).__module__])
    rotation = modeling["apply_rotary_pos_emb"]
    relevancy.explain(model, batch("left"), method=method)
    assert_same(before, snapshot(model))

    def failing(logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a failing target")

    with pytest.raises(RuntimeError, match="a failing target"):
        relevancy.explain(model, batch("left"), method=method, target=failing)
    assert_same(before, snapshot(model))
    assert modeling["apply_rotary_pos_emb"] is rotation
