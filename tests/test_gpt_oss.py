"""gpt-oss (a tiny random float64 `GptOssForCausalLM` of `decoder_families.py`), which lxt has no map of: attention
with a sink per head, a sliding-window layer and a full one, a mixture of experts with biases and a clamped SwiGLU.
The sinks' softmax is the model's own, the sinks take no relevance (the seeds' rules and CP-LRP conserve where
nothing else keeps a share) and raw attention reads the model's own probabilities; the plain gradient, the model's
own logits, padding and the model unchanged: test_new_decoder_layouts.py, with the other new layouts."""
from __future__ import annotations

import pytest
import torch
from decoder_families import build
from test_causal_lm import assert_close_to
from test_decoder_families import batch, model_of

import relevancy
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.lrp.attention import attend
from relevancy.lrp.engine import Session
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
    q.requires_grad_(True)
    context, _ = attend(Session(ATTNLRP), q, k, v, 8 ** -0.5, mask, sinks=sinks, probabilities=False)
    context.sum().backward()
    assert sinks.grad is None and q.grad is not None and torch.isfinite(q.grad).all()


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
